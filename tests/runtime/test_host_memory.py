"""The C heap keeps freed memory for the next large tensor (runtime/host_memory.py, ``--malloc-tuning``).

The pure part (which ``mallopt`` calls, refused values) is tested directly; the effect is measured as
the kernel counts it (minor page faults of a process that allocates, fills and frees image-sized
buffers the way a batch of requests does), and ``sluice serve`` says at start what it set, with and
without protocol workers answering through it.
"""

from __future__ import annotations

import platform
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from sluice.runtime import host_memory
from sluice.runtime.settings import MallocTuning, ServerSettings

from .conftest import ADD_SUB_CONFIG, BUILDERS, write_model  # type: ignore[import-not-found]
from .test_cli_shutdown import start_ports  # type: ignore[import-not-found]

GLIBC = platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason="mallopt's parameters are glibc's; this C library is not glibc")


def test_the_default_settings_turn_tuning_on_and_name_the_calls():
    assert ServerSettings(model_repository=Path("repo")).malloc_tuning == MallocTuning()
    assert host_memory.mallopt_calls(MallocTuning()) == (
        (host_memory.M_MMAP_THRESHOLD, 32 << 20),
        (host_memory.M_TRIM_THRESHOLD, 256 << 20),
    )
    assert host_memory.describe(MallocTuning()) == (
        "host memory: blocks under 32 MiB reuse the heap; up to 256 MiB of freed heap is kept "
        "(--malloc-tuning off for glibc's defaults)"
    )
    assert host_memory.apply(None) is None  # --malloc-tuning off: nothing is called


@pytest.mark.parametrize(
    ("tuning", "words"),
    [
        (MallocTuning(mmap_threshold_bytes=0), "mmap threshold 0 bytes; allowed: 1 to 33554432 (32 MiB)"),
        (MallocTuning(mmap_threshold_bytes=64 << 20), "mmap threshold 67108864 bytes; allowed: 1 to 33554432"),
        (MallocTuning(trim_threshold_bytes=-1), "trim threshold -1 bytes; allowed: 0 to 2147483647"),
        (MallocTuning(trim_threshold_bytes=2**31), "trim threshold 2147483648 bytes; allowed: 0 to 2147483647"),
    ],
)
def test_values_glibc_would_refuse_are_refused_with_the_range(tuning, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        host_memory.mallopt_calls(tuning)


FAULTS = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from sluice.runtime import host_memory
    from sluice.runtime.settings import MallocTuning

    print(host_memory.apply(MallocTuning() if sys.argv[1] == "on" else None))
    rounds = []
    for _ in range(12):  # a batch of 64 fp16 images decoded, used and answered, again and again
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        images = [np.empty((3, 224, 224), np.float16) for _ in range(64)]
        for image in images:
            image.fill(1)
        batches = [np.concatenate([i[None] for i in images[k : k + 16]]) for k in range(0, 64, 16)]  # merged
        del images, batches
        rounds.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(max(rounds[2:]))
""")


@needs_glibc
def test_tuned_heap_reuses_freed_image_buffers_instead_of_faulting_pages_in_again(tmp_path):
    """64 buffers of 294 KiB filled, merged four batches of 16 and freed, per round: with glibc's defaults
    every round faults a share of their pages in again (the 4.6 MiB batches raise the dynamic mmap
    threshold, the freed heap top past twice that goes back to the kernel; ~1,700-2,000 faults a round
    measured); tuned, rounds after the first reuse the heap (the kernel's own count of minor faults)."""
    pages_per_round = 2 * 64 * 3 * 224 * 224 * 2 // 4096
    faults = {}
    for mode in ("off", "on"):
        out = subprocess.run(
            [sys.executable, "-P", "-c", FAULTS, mode], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert out.returncode == 0, out.stderr
        said, worst = out.stdout.split("\n")[:2]
        assert said == ("None" if mode == "off" else host_memory.describe(MallocTuning()))
        faults[mode] = int(worst)
    assert faults["off"] > pages_per_round // 10, faults
    assert faults["on"] < pages_per_round // 100, faults


@needs_glibc
@pytest.mark.parametrize("workers", ["0", "1"])
def test_serve_says_what_it_set_and_serves_with_it(tmp_path, workers):
    repo = tmp_path / "repo"
    write_model(repo, "add_sub", ADD_SUB_CONFIG, {"model.onnx": BUILDERS.add_sub_model()})
    for mode in ("on", "off"):
        proc, ports = start_ports(repo, tmp_path, "--malloc-tuning", mode, "--protocol-workers", workers)
        try:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc']}")
            x = np.arange(16, dtype=np.float32)
            inputs = [grpcclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(x)
            np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), 2 * x)
            client.close()
        finally:
            proc.send_signal(signal.SIGINT)  # stop now: SIGTERM would drain for 5 s
            rest = proc.communicate(timeout=30)[0]
        said = host_memory.describe(MallocTuning()) in proc.startup_output + rest  # type: ignore[attr-defined]
        assert said == (mode == "on"), (mode, proc.startup_output)


def test_a_bad_value_is_refused_naming_the_choices(tmp_path):
    out = subprocess.run(
        [sys.executable, "-P", "-m", "sluice.runtime", "serve", "--model-repository", str(tmp_path),
         "--malloc-tuning", "maybe"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2
    # Python's argparse quotes the choices in some versions and not in others
    refused = r"--malloc-tuning: invalid choice: 'maybe' \(choose from '?on'?, '?off'?\)"
    assert re.search(refused, out.stderr), out.stderr
