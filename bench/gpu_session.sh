#!/usr/bin/env bash
# The GPU checks of Sluice in a few commands, for a machine with an NVIDIA GPU and a CUDA build of
# torch but without network access (and so without `pip install -e .`): it puts the checkout's
# packages on PYTHONPATH through a link tree outside the repository (never the repository root, where
# ./operator would shadow the standard library) and installs wheels brought along in .whl/.
#
#   bash bench/gpu_session.sh STEP...      STEP: close | quick | followup | figures | tests | resnet | resnet-small | resnet-workers | memory | workers | shm | all
#
# A lease of 15 minutes of device time (machine start included) holds one `quick` call, not the
# full steps (each up to 10 minutes): `quick` runs the essentials, each capped by `timeout`
# and each into its own file, so a cap or a failure costs that part only; $OUT/quick-times.txt says
# how long each took, to size the next call.
#
# Each step writes its output to $OUT/<step>.txt as well (OUT defaults to ./gpu-out, ignored by git).
#   close         everything issue 14's "Done means" still needs, in one device call: the GPU tests
#                 (cap 170 s), ResNet c1..c256 over both protocols with the server's breakdown and py-spy
#                 at gRPC c256 (cap 150 s), ResNet with 8 protocol workers at c32..c256 (cap 80 s; driven
#                 by perf_analyzer where the carried one runs, machine.txt says), the encoder with 0, 1, 2,
#                 4, 8, 16 protocol workers (cap 130 s): at most ~9 minutes, timeout_s 560; each part
#                 capped and in its own file, times in $OUT/quick-times.txt. Then, if the lease has time
#                 left: `figures-rest`.
#                 What comes back: $OUT/<step>.txt (every part's output), machine.txt, quick-times.txt,
#                 and parts.tar with each part's own file and py-spy's stacks (the device tool returns
#                 at most 8 files).
#   figures-rest  what `close` leaves: memory per served instance, ResNet with 4 instances, CUDA shm,
#                 the staging merge: at most ~4 minutes, timeout_s 260
#   quick         tests (cap 200 s), a short ResNet run at c1/c32/c128 over both protocols with the
#                 server's time breakdown and py-spy on it at gRPC c128 (100 s), memory with and without graphs (30 s), encoder with
#                 0/4/16 protocol workers (70 s), the staging merge on the CPU (30 s): at most ~7.5
#                 minutes (4 min 40 s on the H100 machine, 2026-11-27); give the device call timeout_s 540
#   followup      after quick: the tests again, ResNet c32/c128/c256 with the server's time breakdown, and
#                 over gRPC with 8 protocol workers at c64/c256: at most ~5.5 minutes; timeout_s 370
#   figures       what quick does not take: ResNet c1..c256 both protocols and with 8 protocol workers
#                 (2 and 4 instances), the encoder at 1/2/8 workers, memory per served instance, CUDA
#                 shm: at most ~8 minutes, timeout_s 500 (each part its own file: a cut run keeps the rest)
#   tests         the GPU tests (PyTorch on CUDA, CUDA graphs, NVML, CUDA shared memory), -rs for skips
#   resnet        bench/gpu_resnet.py: ResNet-50 fp16 channels_last, raw with CUDA graphs vs served
#   resnet-small  the same, short (a check that the bench runs before the long one)
#   resnet-workers  the served ResNet run over gRPC with 8 protocol workers (c32..c256)
#   memory        bench/gpu_memory.py: GPU memory per instance with and without CUDA graphs, and served
#   workers       bench/frontend_workers.py: inferences/s versus protocol workers (encoder on the GPU,
#                 embed and 294 KiB images on the CPU), 1..16 workers
#   shm           bench/cuda_shm.py: CUDA shared memory versus the wire
# Wheels: .whl/ (or $SLUICE_GPU_WHEELS) holds what the machine lacks (tritonclient and its HTTP
# client, httptools, h2/hpack, pytest and its plugins, hypothesis, onnx, ml_dtypes, pyyaml):
# `bash bench/gpu_wheels.sh` fills it on a machine with network access (about 38 MB, cp312).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${SLUICE_GPU_SITE:-/tmp/sluice-gpu-site}
WHEELS=${SLUICE_GPU_WHEELS:-.whl}

setup() {
  if [ ! -e "$SITE/.ready" ]; then
    mkdir -p "$SITE/pkgs/sluice"
    local wheels=() pa_wheel="" wheel
    for wheel in "$WHEELS"/*.whl; do
      case $(basename "$wheel") in
        perf_analyzer-*) pa_wheel=$wheel ;;  # a binary for glibc 2.38+: unpacked, not installed by pip
        *) [ -e "$wheel" ] && wheels+=("$wheel") ;;
      esac
    done
    if [ ${#wheels[@]} -gt 0 ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE/wheels" \
        "${wheels[@]}" || return 1
    fi
    if [ -n "$pa_wheel" ]; then
      "$PY" -m zipfile -e "$pa_wheel" "$SITE/wheels" && chmod +x "$SITE/wheels/perf_analyzer/bin/perf_analyzer"
    fi
    # the package-dir mapping of pyproject.toml, as links: sluice.runtime -> runtime/, and so on
    ln -sfn "$PWD/runtime" "$SITE/pkgs/sluice/runtime"
    ln -sfn "$PWD/operator" "$SITE/pkgs/sluice/operator"
    ln -sfn "$PWD/runtime/client" "$SITE/pkgs/sluice/client"
    touch "$SITE/.ready"
  fi
  export PYTHONPATH="$SITE/pkgs:$SITE/wheels${PYTHONPATH:+:$PYTHONPATH}"
  # py-spy (a wheel in .whl/): gpu_resnet.py --profile-s samples the server with it
  if [ -x "$SITE/wheels/bin/py-spy" ]; then export SLUICE_PY_SPY="$SITE/wheels/bin/py-spy"; fi
  # perf_analyzer (Triton's C++ load generator, a manylinux_2_38 wheel in .whl/): used where it runs
  # (glibc 2.38 and libstdc++ of GCC 13 or newer), so the client costs the server's cores less
  PERF_ANALYZER=""
  local pa="$SITE/wheels/perf_analyzer/bin/perf_analyzer"
  if [ -x "$pa" ] && "$pa" --version >/dev/null 2>&1; then PERF_ANALYZER=$pa; fi
  {
    echo "load generator for resnet-workers: ${PERF_ANALYZER:+perf_analyzer }${PERF_ANALYZER:-tritonclient asyncio clients (perf_analyzer not carried or does not run here)}"
    nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv || true
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    nproc
    echo "net.core.somaxconn $(cat /proc/sys/net/core/somaxconn 2>/dev/null)"
    "$PY" -P -c 'from sluice.runtime import frontend_workers as f; cpus, found = f.usable_cpus(); print("--protocol-workers auto:", f.auto_protocol_workers(cpus), "for", found)'
  } 2>&1 | tee "$OUT/machine.txt"
}

capped() {  # SECONDS NAME COMMAND...: one part of `quick`, into $OUT/quick-NAME.txt, timed
  local cap=$1 name=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== quick $name (cap ${cap}s)" | tee "$OUT/quick-$name.txt"
  timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$OUT/quick-$name.txt"
  rc=${PIPESTATUS[0]}
  echo "$name rc=$rc $(( $(date +%s) - start ))s (cap ${cap}s)" | tee -a "$OUT/quick-times.txt"
  stow
  return "$rc"
}

# The device tool brings back at most 8 files from $OUT: the step logs (each holds its parts' output),
# machine.txt and quick-times.txt stay loose; the rest (each part's own file, py-spy's stacks) are
# appended to $OUT/parts.tar after each part, so a call cut short by its limit still brings back all
# but the part it was in. Only the outermost invocation stows (`close` runs `tests` through this script).
stow() {
  [ "$SLUICE_GPU_SESSION_TOP" = $$ ] || return 0
  local keep='^(machine\.txt|quick-times\.txt|parts\.tar)$' one name rest=()
  for one in "${steps[@]}"; do keep="$keep|^$one\.txt\$"; done
  while IFS= read -r name; do [[ $name =~ $keep ]] || rest+=("$name"); done < <(ls "$OUT")
  if [ ${#rest[@]} -gt 0 ]; then
    tar -rf "$OUT/parts.tar" -C "$OUT" -- "${rest[@]}" && (cd "$OUT" && rm -rf -- "${rest[@]}")
  fi
}

run_step() {
  local step=$1
  case $step in
    quick)
      local failed=0
      capped 200 tests bash "$0" tests || failed=1
      capped 100 resnet "$PY" -P bench/gpu_resnet.py --concurrency 1,32,128 --duration-s 4 --raw-s 1 \
        --client-processes 8 --profile-s 4 --profile-dir "$OUT" || failed=1
      capped 30 memory "$PY" -P bench/gpu_memory.py || failed=1
      capped 70 workers "$PY" -P bench/frontend_workers.py --model encoder --device cuda:0 --workers 0,4,16 \
        --concurrency 256 --connections 64 --client-processes 8 --seconds 4 --warmup 1 || failed=1
      capped 30 merge "$PY" -P bench/staging_merge.py --parts 8,32,128 --torch-threads 1 || failed=1
      return $failed ;;
    close)
      local failed=0
      capped 170 tests bash "$0" tests || failed=1
      capped 150 resnet "$PY" -P bench/gpu_resnet.py --concurrency 1,8,32,64,128,256 --duration-s 4 --raw-s 1 \
        --client-processes 8 --profile-s 4 --profile-dir "$OUT" || failed=1
      # with 8 workers the asyncio clients (8 processes) compete for the 16 cores: perf_analyzer where it runs
      SLUICE_PERF_ANALYZER=$PERF_ANALYZER capped 80 resnet-workers "$PY" -P bench/gpu_resnet.py --mode served \
        --protocols grpc --concurrency 32,64,128,256 --duration-s 4 --raw-s 1 --client-processes 8 \
        --serve-arg=--protocol-workers=8 || failed=1
      capped 130 workers "$PY" -P bench/frontend_workers.py --model encoder --device cuda:0 --workers 0,1,2,4,8,16 \
        --concurrency 256 --connections 64 --client-processes 8 --seconds 4 --warmup 1 || failed=1
      return $failed ;;
    figures-rest)
      local failed=0
      capped 75 memory "$PY" -P bench/gpu_memory.py --served || failed=1
      capped 60 resnet-workers-4 "$PY" -P bench/gpu_resnet.py --mode served --protocols grpc --concurrency 64,256 \
        --duration-s 4 --raw-s 0.5 --client-processes 8 --instances 4 --serve-arg=--protocol-workers=8 || failed=1
      capped 40 shm "$PY" -P bench/cuda_shm.py || failed=1
      capped 30 merge "$PY" -P bench/staging_merge.py --parts 8,32,128 --torch-threads 1 || failed=1
      return $failed ;;
    followup)
      # after a `quick` in the same session: the GPU tests again (after fixes), and ResNet with the
      # server's time breakdown, one process and 8 protocol workers: at most ~5.5 minutes, timeout_s 370
      local failed=0
      capped 170 tests bash "$0" tests || failed=1
      capped 70 resnet "$PY" -P bench/gpu_resnet.py --concurrency 32,128,256 --duration-s 4 --raw-s 1 \
        --client-processes 8 || failed=1
      capped 70 resnet-workers "$PY" -P bench/gpu_resnet.py --mode served --protocols grpc --concurrency 64,256 \
        --duration-s 4 --raw-s 1 --client-processes 8 --serve-arg=--protocol-workers=8 || failed=1
      return $failed ;;
    figures)
      # the figures issue 14 still lacks after quick/followup: ResNet over c1..c256 both protocols
      # and with 8 protocol workers (2 and 4 instances), the encoder at 1/2/8 workers, memory per
      # served instance, CUDA shared memory: at most ~8 minutes; timeout_s 500
      local failed=0
      capped 140 resnet "$PY" -P bench/gpu_resnet.py --concurrency 1,8,32,64,128,256 --duration-s 4 --raw-s 1 \
        --client-processes 8 || failed=1
      capped 80 resnet-workers "$PY" -P bench/gpu_resnet.py --mode served --protocols grpc \
        --concurrency 32,64,128,256 --duration-s 4 --raw-s 1 --client-processes 8 \
        --serve-arg=--protocol-workers=8 --profile-s 4 --profile-dir "$OUT" || failed=1
      # the same with 4 instances: does a third and fourth hide the host work of each execution?
      capped 60 resnet-workers-4 "$PY" -P bench/gpu_resnet.py --mode served --protocols grpc --concurrency 64,256 \
        --duration-s 4 --raw-s 0.5 --client-processes 8 --instances 4 --serve-arg=--protocol-workers=8 || failed=1
      capped 70 workers "$PY" -P bench/frontend_workers.py --model encoder --device cuda:0 --workers 1,2,8 \
        --concurrency 256 --connections 64 --client-processes 8 --seconds 4 --warmup 1 || failed=1
      capped 75 memory "$PY" -P bench/gpu_memory.py --served || failed=1
      capped 40 shm "$PY" -P bench/cuda_shm.py || failed=1
      return $failed ;;
    tests)
      "$PY" -m pytest -q -p no:cacheprovider -rs -o addopts="--import-mode=importlib" \
        tests/runtime/test_pytorch_backend.py tests/runtime/test_pytorch_conformance.py tests/runtime/test_torch_graphs.py \
        tests/runtime/test_tensor_merge.py tests/runtime/test_gpu_telemetry.py \
        tests/runtime/test_cuda_shared_memory.py tests/runtime/test_onnx_gpu.py tests/runtime/test_tensorrt_backend.py \
        tests/test_bench_gpu.py ;;
    resnet-small)
      "$PY" -P bench/gpu_resnet.py --small --duration-s 2 --raw-s 1 --concurrency 1,16 ;;
    resnet)
      "$PY" -P bench/gpu_resnet.py --concurrency 1,8,32,64,128,256 --duration-s 8 --raw-s 3 \
        --client-processes 8 ;;
    resnet-workers)
      # the single process decodes ~3k images/s per core (docs/performance.md, "Large tensors"):
      # the same served run with 8 protocol workers, gRPC, from the concurrency where batches form
      "$PY" -P bench/gpu_resnet.py --mode served --protocols grpc --concurrency 32,64,128,256 --duration-s 8 \
        --raw-s 3 --client-processes 8 --serve-arg=--protocol-workers=8 ;;
    memory)
      "$PY" -P bench/gpu_memory.py && "$PY" -P bench/gpu_memory.py --served ;;
    workers)
      "$PY" -P bench/frontend_workers.py --model encoder --device cuda:0 --workers 0,1,2,4,8,16 \
        --concurrency 256 --connections 64 --client-processes 8 --seconds 6 &&
      "$PY" -P bench/frontend_workers.py --workers 0,1,2,4,8 --concurrency 128 --connections 32 \
        --client-processes 6 --seconds 6 &&
      "$PY" -P bench/frontend_workers.py --model image --workers 0,1,2,4,8 --malloc-tuning off,on \
        --concurrency 64 --connections 16 --client-processes 4 --seconds 6 ;;
    shm)
      "$PY" -P bench/cuda_shm.py ;;
    *)
      echo "unknown step '$step'; allowed: close, figures-rest, quick, followup, figures, tests, resnet, resnet-small, resnet-workers, memory, workers, shm, all" >&2
      return 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | grep '^#'; exit 2; }
export SLUICE_GPU_SESSION_TOP=${SLUICE_GPU_SESSION_TOP:-$$}
setup || { echo "setup failed" >&2; exit 1; }
steps=()
for step in "$@"; do
  if [ "$step" = all ]; then steps+=(tests resnet resnet-workers memory workers shm); else steps+=("$step"); fi
done
status=0
for one in "${steps[@]}"; do
  echo "== $one" | tee "$OUT/$one.txt"
  run_step "$one" 2>&1 | tee -a "$OUT/$one.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
stow
exit $status
