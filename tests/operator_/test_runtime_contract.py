"""The runtime contract: the real ``sluice serve`` started exactly as a rendered Deployment starts it.

The operator and the runtime never import each other, so nothing but this test checks that what the
builders render is what the runtime understands. The pod is laid out on disk the way kubelet would:
the ConfigMap's keys at the Deployment's ``subPath`` mounts, the model files fetched by running the
init container's own command and args (``sluice pull s3://...``) against an S3-compatible server on
loopback (moto). Then the container's own command and args run, with only the paths and port numbers
mapped, and the test does what kubelet and the HPA's metrics adapter do: probe readiness and liveness
on an address other than the one the runtime would default to, and scrape the queue-depth gauge the
HPA names.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from sluice.operator import api, builders
from sluice.operator.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
ADD_SUB = ROOT / "examples" / "model_repository" / "add_sub"
# Linux routes all of 127/8 to loopback: a server bound to 127.0.0.1 only refuses 127.0.0.2, one
# bound to 0.0.0.0 (as a pod must be, for kubelet probes and the Service) accepts it.
POD_IP = "127.0.0.2"
Pod = tuple[tuple[dict[str, Any], ...], dict[str, int], "subprocess.Popen[str]"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rendered(name: str, spec: dict[str, Any], settings: Settings) -> tuple[dict[str, Any], ...]:
    owner = builders.Owner(kind=api.INFERENCE_MODEL_KIND, name=name, namespace="models", uid="uid-1")
    return builders.inference_model(owner, api.parse_inference_model(name, spec), settings).objects


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server on loopback holding the add_sub model at s3://bucket/add_sub; the fetch's environment."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket="bucket")
    for path in (ADD_SUB / "1").rglob("*"):
        if path.is_file():
            client.put_object(Bucket="bucket", Key=f"add_sub/{path.relative_to(ADD_SUB / '1').as_posix()}",
                              Body=path.read_bytes())
    yield env
    server.stop()


def lay_out_pod(objects: tuple[dict[str, Any], ...], root: pathlib.Path, env: dict[str, str]) -> list[str]:
    """Materialize the pod's /models on disk (the init containers run); return the runtime's command line."""
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap"]
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]

    def host_path(path: str) -> pathlib.Path:
        assert path.startswith(builders.MODEL_REPOSITORY), path
        return root / path[len(builders.MODEL_REPOSITORY):].lstrip("/")

    for init in pod.get("initContainers", []):  # sluice pull <uri> <destination>, as the kubelet runs it
        fetch = shutil.which(init["command"][0], path=os.path.dirname(sys.executable))
        assert fetch, f"{init['command'][0]!r} is not installed next to {sys.executable}"
        args = [str(host_path(a)) if a.startswith(builders.MODEL_REPOSITORY) else a for a in init["args"]]
        done = subprocess.run([fetch, *args], env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
    for mount in container["volumeMounts"]:
        if mount["name"] == "model-config":
            target = host_path(mount["mountPath"])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(config_map["data"][mount["subPath"]])
    executable = shutil.which(container["command"][0], path=os.path.dirname(sys.executable))
    assert executable, f"{container['command'][0]!r} is not installed next to {sys.executable}"
    return [executable, *container["args"]]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


SPECS: dict[str, dict[str, Any]] = {
    # config.json rendered from spec.runtime (Triton field names); inputs auto-completed from model.onnx
    "rendered-config": {"model": {"storageUri": "s3://bucket/add_sub", "format": "onnx"}},
    # an inline config.pbtxt, used verbatim
    "inline-pbtxt": {"model": {"storageUri": "s3://bucket/add_sub", "format": "onnx",
                               "config": (ADD_SUB / "config.pbtxt").read_text().replace('"add_sub"', '"addsub"')}},
    # two protocol worker processes decode the requests (spec.server)
    "protocol-workers": {"model": {"storageUri": "s3://bucket/add_sub", "format": "onnx"},
                         "server": {"protocolWorkers": 2}},
}


@contextlib.contextmanager
def started_pod(spec: dict[str, Any], root: pathlib.Path, env: dict[str, str]) -> Iterator[Pod]:
    """``spec`` rendered as ``addsub`` on free ports, laid out under ``root`` and its runtime started;
    SIGTERM (then SIGKILL) at the end, as kubelet stops a pod."""
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    settings = Settings(http_port=ports["http"], grpc_port=ports["grpc"], metrics_port=ports["metrics"])
    objects = rendered("addsub", spec, settings)
    repository = root / "models"
    argv = lay_out_pod(objects, repository, env)
    argv = [str(repository) if arg == builders.MODEL_REPOSITORY else arg for arg in argv]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield objects, ports, process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(params=sorted(SPECS))
def pod(request: pytest.FixtureRequest, tmp_path: pathlib.Path, s3_env: dict[str, str]) -> Iterator[Pod]:
    with started_pod({**SPECS[request.param], "scaling": {"minReplicas": 1, "maxReplicas": 2}}, tmp_path,
                     s3_env) as running:
        yield running


def infer_both_protocols(ports: dict[str, int], inputs: dict[str, Any], expected: dict[str, Any]) -> None:
    """``addsub`` called through the pod's HTTP and gRPC ports with tritonclient: ``expected`` outputs."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    for module, port in ((httpclient, ports["http"]), (grpcclient, ports["grpc"])):
        client = module.InferenceServerClient(f"{POD_IP}:{port}")
        try:
            tensors = []
            for name, array in inputs.items():
                tensors.append(module.InferInput(name, list(array.shape), "FP32"))
                tensors[-1].set_data_from_numpy(array)
            result = client.infer("addsub", tensors)
            for name, array in expected.items():
                np.testing.assert_array_equal(result.as_numpy(name), array)
        finally:
            client.close()


def _container(objects: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    pod_spec = deployment["spec"]["template"]["spec"]
    [container] = pod_spec["containers"]
    return pod_spec, container


def _probe_url(container: dict[str, Any], probe: dict[str, Any]) -> str:
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    return f"http://{POD_IP}:{named[probe['httpGet']['port']]}{probe['httpGet']['path']}"


def _wait_ready(container: dict[str, Any], process: subprocess.Popen[str]) -> str:
    """Probe readiness as kubelet does until it answers 200; return the probe URL."""
    readiness = _probe_url(container, container["readinessProbe"])
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            pytest.fail(f"the runtime exited with {process.returncode}:\n{process.stdout.read()}")
        try:
            status, _ = get(readiness)
        except OSError:  # not listening yet (or, the bug this catches, only on 127.0.0.1)
            status = 0
        if status == 200:
            break
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"{readiness} never answered 200 (last {status}):\n{process.communicate()[0]}")
        time.sleep(0.05)
    return readiness


def test_the_rendered_pod_serves_probes_and_the_hpa_metric(pod):
    objects, ports, process = pod
    _, container = _container(objects)
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == ports
    readiness = _wait_ready(container, process)
    assert readiness.endswith("/v2/health/ready")
    assert get(_probe_url(container, container["livenessProbe"]))[0] == 200
    assert get(_probe_url(container, container["startupProbe"]))[0] == 200

    # The model is served under the name and version the status URL names, with the rendered config.
    status, body = get(f"http://{POD_IP}:{ports['http']}/v2/models/addsub/versions/1/ready")
    assert status == 200, body

    [hpa] = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    _, exposition = get(f"http://{POD_IP}:{named['metrics']}/metrics")
    samples = [line for line in exposition.splitlines() if line.startswith(metric + "{")]
    assert any('model="addsub"' in line and 'version="1"' in line for line in samples), exposition[:2000]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc, as ``ps --ppid`` reads it)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_the_rendered_pod_answers_tritonclient_over_both_protocols(pod, request):
    """Inference through the Service's ports as the pod runs them; with spec.server.protocolWorkers the
    runtime starts that many worker processes and the requests are decoded there."""
    import numpy as np

    objects, ports, process = pod
    _, container = _container(objects)
    _wait_ready(container, process)
    workers = SPECS[request.node.callspec.params["pod"]].get("server", {}).get("protocolWorkers", 0)
    assert len(_children(process.pid)) == workers
    a, b = np.arange(16, dtype=np.float32), np.full(16, 2, dtype=np.float32)
    infer_both_protocols(ports, {"INPUT0": a, "INPUT1": b}, {"OUTPUT0": a + b, "OUTPUT1": a - b})
    # Which process answered: a worker names itself in a response header (HTTP).
    request = urllib.request.Request(f"http://{POD_IP}:{ports['http']}/v2/models/addsub/versions/1")
    with urllib.request.urlopen(request, timeout=5) as response:
        served_by = response.headers.get("sluice-worker")
    assert (served_by is not None) == (workers > 0), served_by


def test_the_rendered_pod_stops_cleanly_within_its_grace_period(pod):
    # kubelet runs the preStop hook (the drain: the pod leaves the endpoints while it still serves),
    # then sends SIGTERM; what is left of terminationGracePeriodSeconds is the runtime's to exit 0.
    objects, _, process = pod
    pod_spec, container = _container(objects)
    _wait_ready(container, process)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and shutil.which("sleep"), command
    left = pod_spec["terminationGracePeriodSeconds"] - int(command[1])
    process.send_signal(signal.SIGTERM)
    try:
        returncode = process.wait(timeout=left)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the runtime was still running {left} s after SIGTERM: kubelet would SIGKILL it")
    assert returncode == 0, process.stdout.read() if process.stdout else ""


# ---------------------------------------------------------------- PyTorch models

TORCH_MISSING = importlib.util.find_spec("torch") is None
TORCHSCRIPT_CONFIG = """platform: "pytorch_libtorch"
max_batch_size: 8
dynamic_batching { }
input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] },
        { name: "INPUT__1", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] },
         { name: "OUTPUT__1", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


@pytest.mark.skipif(TORCH_MISSING, reason="torch is not installed (the torch extra; pip install torch==2.13.0)")
@pytest.mark.parametrize("case", ["torchscript-inline-config", "torch-export-one-object"])
def test_a_rendered_pytorch_pod_serves_tritonclient(case: str, tmp_path: pathlib.Path,
                                                    s3_env: dict[str, str]) -> None:
    """``format: torchscript`` from S3 as a platform team deploys it: a TorchScript prefix with its config
    inline, or one ``torch.export`` object (``.pt2``, its own name kept by the fetch) whose config the
    runtime completes from the program; rendered, fetched and started as kubelet would, then called."""
    import numpy as np
    import torch

    class AddSub(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + y, x - y

    s3 = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
    saved = tmp_path / "saved"
    if case == "torchscript-inline-config":
        torch.jit.script(AddSub()).save(str(saved))
        s3.put_object(Bucket="bucket", Key="pt/ts/model.pt", Body=saved.read_bytes())
        model = {"storageUri": "s3://bucket/pt/ts", "format": "torchscript", "config": TORCHSCRIPT_CONFIG}
        spec: dict[str, Any] = {"model": model}
        names = ("INPUT__0", "INPUT__1")
    else:
        batch = torch.export.Dim("batch", min=1, max=64)
        program = torch.export.export(AddSub(), (torch.zeros(2, 4), torch.zeros(2, 4)),
                                      dynamic_shapes=({0: batch}, {0: batch}))
        torch.export.save(program, str(saved))
        s3.put_object(Bucket="bucket", Key="pt/export/addsub.pt2", Body=saved.read_bytes())
        spec = {"model": {"storageUri": "s3://bucket/pt/export/addsub.pt2", "format": "torchscript"},
                "runtime": {"maxBatchSize": 8, "dynamicBatching": {"maxQueueDelayMicroseconds": 100}}}
        names = ("x", "y")  # forward()'s argument names
    with started_pod(spec, tmp_path, s3_env) as (objects, ports, process):
        _wait_ready(_container(objects)[1], process)
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        y = np.ones((3, 4), dtype=np.float32)
        infer_both_protocols(ports, dict(zip(names, (x, y), strict=True)), {"OUTPUT__0": x + y, "OUTPUT__1": x - y})


# ---------------------------------------------------------------- the injected sidecar

def test_the_injected_sidecar_serves_over_its_socket_and_shared_memory(s3_env: dict[str, str]) -> None:
    """An application pod as the webhook patches it: the fetch init container's ``sluice pull`` and the
    ``sluice-runtime`` native sidecar's own command line run, with only paths and port numbers mapped. The
    kubelet's probes reach the pod IP; inference does not (loopback only); the application calls the
    runtime with tritonclient on the gRPC socket its env names, tensors in /dev/shm."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm

    from sluice.operator import sidecar

    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    settings = Settings(http_port=ports["http"], grpc_port=ports["grpc"], metrics_port=ports["metrics"])
    spec = {"mode": "Sidecar", "model": {"storageUri": "s3://bucket/add_sub", "format": "onnx"}}
    known = {"addsub": sidecar.indexed("addsub", spec, sidecar.rendered(1), 1)}
    app = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "shop", "namespace": "models", "annotations": {sidecar.INJECT_ANNOTATION: "addsub"}},
           "spec": {"containers": [{"name": "shop", "image": "registry.example.com/shop:1"}]}}
    sidecar.apply(app, sidecar.admit(app, known, settings, native=True))
    owner = builders.Owner(kind=api.INFERENCE_MODEL_KIND, name="addsub", namespace="models", uid="uid-1")
    [config_map] = sidecar.children(owner, api.parse_inference_model("addsub", spec), settings).objects

    # A short root: a Unix socket path has at most 107 bytes.
    root = pathlib.Path(tempfile.mkdtemp(prefix="sc-", dir="/tmp"))
    mapped = {builders.MODEL_REPOSITORY: root / "models", sidecar.SOCKET_DIRECTORY: root / "run"}

    def host(arg: str) -> str:
        for inside, outside in mapped.items():
            if arg == inside or arg.startswith(inside + "/"):
                return str(outside) + arg[len(inside):]
        return arg

    inits = app["spec"]["initContainers"]
    [runtime] = [c for c in inits if c["name"] == sidecar.CONTAINER]
    assert runtime["restartPolicy"] == "Always"
    for fetch in inits[:inits.index(runtime)]:
        executable = shutil.which(fetch["command"][0], path=os.path.dirname(sys.executable))
        assert executable
        done = subprocess.run([executable, *map(host, fetch["args"])], env={**os.environ, **s3_env},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    for mount in runtime["volumeMounts"]:
        if mount["name"].startswith("sluice-config-"):
            target = pathlib.Path(host(mount["mountPath"]))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(config_map["data"][mount["subPath"]])
    (root / "run").mkdir()
    executable = shutil.which(runtime["command"][0], path=os.path.dirname(sys.executable))
    assert executable
    process = subprocess.Popen([executable, *map(host, runtime["args"])], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    regions: list[Any] = []
    try:
        _wait_ready(runtime, process)  # the startup and readiness probes, on the pod IP
        assert get(_probe_url(runtime, runtime["startupProbe"]))[0] == 200
        assert get(_probe_url(runtime, runtime["livenessProbe"]))[0] == 200
        with pytest.raises(OSError):  # inference is the pod's own: not on the pod IP
            get(f"http://{POD_IP}:{ports['http']}/v2/health/ready")
        assert get(f"http://127.0.0.1:{ports['http']}/v2/models/addsub/ready")[0] == 200

        [shop] = app["spec"]["containers"]
        env = {e["name"]: e["value"] for e in shop["env"]}
        assert {m["mountPath"] for m in shop["volumeMounts"]} == {"/dev/shm", sidecar.SOCKET_DIRECTORY}
        target = "unix://" + host(env["SLUICE_GRPC_UDS"].removeprefix("unix://"))
        client = grpcclient.InferenceServerClient(target)
        x = np.arange(16, dtype=np.float32)
        key = f"/sc_{os.getpid()}"
        region = shm.create_shared_memory_region("sc_in", key, 256)
        regions.append(region)
        shm.set_shared_memory_region(region, [x, x * 3])
        client.register_system_shared_memory("io", key, 256)
        inputs = [grpcclient.InferInput("INPUT0", [16], "FP32"), grpcclient.InferInput("INPUT1", [16], "FP32")]
        inputs[0].set_shared_memory("io", 64)
        inputs[1].set_shared_memory("io", 64, offset=64)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("io", 64, offset=128)
        client.infer("addsub", inputs, outputs=[output, grpcclient.InferRequestedOutput("OUTPUT1")])
        np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, [16], offset=128), x * 4)
        client.unregister_system_shared_memory("io")
        client.close()

        named = {p["name"]: p["containerPort"] for p in runtime["ports"]}
        assert app["metadata"]["annotations"]["prometheus.io/port"] == str(named[sidecar.METRICS_PORT_NAME])
        _, exposition = get(f"http://{POD_IP}:{named[sidecar.METRICS_PORT_NAME]}/metrics")
        assert 'sluice_request_success_total{model="addsub",version="1"} 1.0' in exposition
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            returncode = process.wait(timeout=30)
        finally:
            for region in regions:
                shm.destroy_shared_memory_region(region)
            shutil.rmtree(root, ignore_errors=True)
    assert returncode == 0
    assert not (root / "run" / "grpc.sock").exists()


def test_the_runtime_reads_the_rendered_cuda_graphs_setting_as_the_batch_sizes_to_capture() -> None:
    """``spec.runtime.cudaGraphs`` as the runtime reads the rendered config.json: graphs at the preferred
    batch sizes and maxBatchSize (the capture itself needs a GPU: docs/cuda-graphs.md, tests/runtime)."""
    import json

    from sluice.runtime import config as model_config
    from sluice.runtime.backends.torch_graphs import graph_plan

    spec = {"model": {"storageUri": "s3://bucket/resnet50.pt2", "format": "torchscript"},
            "runtime": {"maxBatchSize": 64, "cudaGraphs": True,
                        "dynamicBatching": {"preferredBatchSizes": [16, 32], "maxQueueDelayMicroseconds": 500}},
            "resources": {"gpu": {"count": 1}}}
    [config_map] = [o for o in rendered("resnet", spec, Settings()) if o["kind"] == "ConfigMap"]
    [text] = config_map["data"].values()
    parsed = model_config.parse_config(text, path="resnet/config.json", fmt="json")
    assert parsed.optimization.cuda.graphs and parsed.default_model_filename == "resnet50.pt2"
    parsed.input.add(name="x", data_type=model_config.mc.TYPE_FP16, dims=[3, 224, 224])  # as the .pt2 completes it
    plan = graph_plan(parsed)
    assert plan is not None and [shape.batch_size for shape in plan.shapes] == [16, 32, 64]
    assert json.loads(text)["instance_group"] == [{"count": 1, "kind": "KIND_GPU"}]


def test_the_operator_bounds_protocol_workers_as_the_runtime_does() -> None:
    """``spec.server.protocolWorkers`` is checked by the operator (and the CRD) with the runtime's own
    bound: a count the runtime would refuse at start must never reach a pod."""
    from sluice.operator import settings
    from sluice.runtime import frontend_workers

    assert api.MAX_PROTOCOL_WORKERS == frontend_workers.MAX_PROTOCOL_WORKERS == settings.MAX_PROTOCOL_WORKERS
    assert frontend_workers.protocol_workers_problem(api.MAX_PROTOCOL_WORKERS) is None
    assert frontend_workers.protocol_workers_problem(api.MAX_PROTOCOL_WORKERS + 1) is not None
