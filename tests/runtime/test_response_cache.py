"""Response cache through Triton's clients: keys, cross-protocol hits, statistics, bounds, metrics."""

from __future__ import annotations

import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from .conftest import write_model  # type: ignore[import-not-found]

COUNTING_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        out = []
        for request in requests:
            self.runs += 1
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("DOUBLE", x * 2),
                pb_utils.Tensor("RUNS", np.full(x.shape, self.runs, dtype=np.float32)),
            ]))
        return out
"""


def config(extra: str = "") -> str:
    return f"""
    name: "cached"
    backend: "python"
    max_batch_size: 4
    input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 2 ] }} ]
    output [
      {{ name: "DOUBLE", data_type: TYPE_FP32, dims: [ 2 ] }},
      {{ name: "RUNS", data_type: TYPE_FP32, dims: [ 2 ] }}
    ]
    response_cache {{ enable: true }}
    {extra}
    """


def infer(server, protocol: str, values, outputs=None):
    mod = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(server.http if protocol == "http" else server.grpc)
    x = np.array([values], dtype=np.float32)
    inp = mod.InferInput("IN", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    requested = [mod.InferRequestedOutput(name) for name in outputs] if outputs else None
    result = client.infer("cached", [inp], outputs=requested)
    client.close()
    return result


def stats(server) -> dict:
    client = httpclient.InferenceServerClient(server.http)
    doc = client.get_inference_statistics("cached")["model_stats"][0]
    client.close()
    return doc


def test_hits_across_protocols_without_running_the_model(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "cached", config(), {"model.py": COUNTING_PY})
    server = serve(repo)
    first = infer(server, "http", [1.0, 2.0])
    assert first.as_numpy("RUNS")[0, 0] == 1
    again = infer(server, "grpc", [1.0, 2.0])  # an entry stored by HTTP serves gRPC
    np.testing.assert_array_equal(again.as_numpy("DOUBLE"), [[2.0, 4.0]])
    assert again.as_numpy("RUNS")[0, 0] == 1  # the model did not run again
    other = infer(server, "grpc", [3.0, 4.0])
    assert other.as_numpy("RUNS")[0, 0] == 2
    # requested outputs are not part of the key; a hit returns what was asked for
    subset = infer(server, "http", [1.0, 2.0], outputs=["DOUBLE"])
    np.testing.assert_array_equal(subset.as_numpy("DOUBLE"), [[2.0, 4.0]])
    assert subset.as_numpy("RUNS") is None
    doc = stats(server)
    inf = doc["inference_stats"]
    assert inf["cache_hit"]["count"] == 2
    assert inf["cache_miss"]["count"] == 2
    assert inf["success"]["count"] == 4
    assert doc["inference_count"] == 2  # hits are neither inferences nor executions
    assert doc["execution_count"] == 2
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'sluice_cache_hit_count_total{model="cached",version="1"} 2.0' in text
    assert 'sluice_cache_miss_count_total{model="cached",version="1"} 2.0' in text


def test_cache_is_bounded_and_evicts_least_recently_used(tmp_path, serve):
    repo = tmp_path / "repo"
    extra = 'parameters { key: "response_cache_bytes" value { string_value: "700" } }'
    write_model(repo, "cached", config(extra), {"model.py": COUNTING_PY})
    server = serve(repo)
    for value in range(5):  # each entry is a few hundred bytes: only about two fit
        infer(server, "http", [float(value), 0.0])
    latest = infer(server, "http", [4.0, 0.0])
    assert latest.as_numpy("RUNS")[0, 0] == 5  # the newest entry is still cached
    oldest = infer(server, "http", [0.0, 0.0])
    assert oldest.as_numpy("RUNS")[0, 0] == 6  # the oldest was evicted and ran again


def test_disabled_cache_always_runs_the_model(tmp_path, serve):
    repo = tmp_path / "repo"
    write_model(repo, "cached", config().replace("response_cache { enable: true }", ""), {"model.py": COUNTING_PY})
    server = serve(repo)
    infer(server, "http", [1.0, 2.0])
    assert infer(server, "http", [1.0, 2.0]).as_numpy("RUNS")[0, 0] == 2
    assert stats(server)["inference_stats"]["cache_hit"].get("count", 0) == 0


LARGE_IN_CONFIG = """
name: "cached"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 16384 ] } ]
output [ { name: "RUNS", data_type: TYPE_FP32, dims: [ 1 ] } ]
response_cache { enable: true }
parameters { key: "response_cache_bytes" value { string_value: "100000" } }
"""

LARGE_IN_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        self.runs += len(requests)
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("RUNS", np.array([self.runs], np.float32))])
            for _ in requests
        ]
"""


def test_the_bound_counts_the_inputs_a_cached_entry_keeps(tmp_path, serve):
    # Entries are keyed by their inputs' bytes: 64 KiB inputs with a 4-byte output must not let
    # a 100 KB cache keep many of them (it kept them all, growing without bound).
    repo = tmp_path / "repo"
    write_model(repo, "cached", LARGE_IN_CONFIG, {"model.py": LARGE_IN_PY})
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)

    def runs(value: float) -> float:
        inp = httpclient.InferInput("IN", [16384], "FP32")
        inp.set_data_from_numpy(np.full(16384, value, np.float32), binary_data=True)
        return float(client.infer("cached", [inp]).as_numpy("RUNS")[0])

    assert [runs(float(v)) for v in range(4)] == [1.0, 2.0, 3.0, 4.0]
    assert runs(3.0) == 4.0  # the newest entry is a hit
    assert runs(0.0) == 5.0  # the oldest did not fit beside it: evicted, the model runs again
    client.close()


LARGE_TEXT_CONFIG = """
name: "text"
backend: "python"
max_batch_size: 0
input [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] }, { name: "RUNS", data_type: TYPE_INT32, dims: [ 1 ] } ]
response_cache { enable: true }
parameters { key: "response_cache_bytes" value { string_value: "100000" } }
"""

LARGE_TEXT_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        out = []
        for request in requests:
            self.runs += 1
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            out.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("TEXT", np.array([(b"%08d" % n) * 5000], dtype=object)),  # 40 KB
                pb_utils.Tensor("RUNS", np.array([self.runs], np.int32))]))
        return out
"""


def test_the_bound_counts_the_bytes_of_text_outputs(tmp_path, serve):
    """BYTES outputs were counted by their pointers (8 bytes an element): a 100 KB cache kept any number
    of 40 KB texts (1 MiB ones grew the process by 200 MiB in 200 requests)."""
    repo = tmp_path / "repo"
    write_model(repo, "text", LARGE_TEXT_CONFIG, {"model.py": LARGE_TEXT_PY})
    server = serve(repo)
    client = httpclient.InferenceServerClient(server.http)

    def runs(n: int) -> int:
        inp = httpclient.InferInput("N", [1], "INT32")
        inp.set_data_from_numpy(np.array([n], np.int32))
        result = client.infer("text", [inp])
        assert result.as_numpy("TEXT")[0] == (b"%08d" % n) * 5000
        return int(result.as_numpy("RUNS")[0])

    assert [runs(n) for n in range(4)] == [1, 2, 3, 4]
    assert runs(3) == 4  # the newest entry is a hit
    assert runs(0) == 5  # two 40 KB texts fit in 100 KB, not four: the oldest was evicted
    client.close()


# -- Triton's server cache: --cache-config local,size=N ----------------------------------------------


def runs_of(server, model: str, values) -> float:
    client = httpclient.InferenceServerClient(server.http)
    x = np.array([values], dtype=np.float32)
    inp = httpclient.InferInput("IN", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    runs = float(client.infer(model, [inp]).as_numpy("RUNS")[0, 0])
    client.close()
    return runs


def test_a_server_cache_is_one_bound_shared_by_every_model(tmp_path, serve):
    """With Triton's --cache-config local,size=N the models share one LRU bound: a second model's
    entries evict the first's (each with its own cache, both would keep theirs)."""
    from sluice.runtime.settings import SchedulingDefaults

    repo = tmp_path / "repo"
    write_model(repo, "cached", config(), {"model.py": COUNTING_PY})
    write_model(repo, "other", config().replace('name: "cached"', 'name: "other"'), {"model.py": COUNTING_PY})
    server = serve(repo, scheduling=SchedulingDefaults(response_cache_shared_bytes=700))  # about two entries
    assert runs_of(server, "cached", [1.0, 0.0]) == 1
    assert runs_of(server, "other", [1.0, 0.0]) == 1
    assert runs_of(server, "cached", [2.0, 0.0]) == 2  # evicts the least recently used: cached [1, 0]
    assert runs_of(server, "other", [1.0, 0.0]) == 1  # still there: a hit
    assert runs_of(server, "cached", [1.0, 0.0]) == 3  # evicted by the other model's entry: ran again
    own = serve(repo)  # without a server cache each version has its own 64 MiB
    for model in ("cached", "other", "cached", "other"):
        runs_of(own, model, [1.0, 0.0])
    assert runs_of(own, "cached", [1.0, 0.0]) == 1


def test_a_reloaded_version_does_not_answer_from_its_predecessors_entries(tmp_path, serve):
    from sluice.runtime.settings import SchedulingDefaults

    repo = tmp_path / "repo"
    write_model(repo, "cached", config(), {"model.py": COUNTING_PY})
    server = serve(repo, model_control_mode="explicit", load_models=("cached",),
                   scheduling=SchedulingDefaults(response_cache_shared_bytes=1 << 20))
    assert runs_of(server, "cached", [1.0, 0.0]) == 1
    assert runs_of(server, "cached", [1.0, 0.0]) == 1  # a hit
    (repo / "cached" / "1" / "model.py").write_text(COUNTING_PY + "\n# changed\n")
    httpclient.InferenceServerClient(server.http).load_model("cached")  # version 1 again, from changed files
    assert runs_of(server, "cached", [1.0, 0.0]) == 1  # its own first run: the old entry is gone
    assert stats(server)["inference_stats"]["cache_hit"].get("count", 0) == 0
