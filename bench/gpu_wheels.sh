#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with the wheels that bench/gpu_session.sh installs on the lent GPU
# machine, which has no network: Python 3.12 there, with torch (CUDA), onnxruntime, numpy, grpcio,
# protobuf, uvloop, prometheus_client and nvidia-ml-py already installed, so those are left out.
# Run it here (network) before the `device` call that carries .whl:
#
#   bash bench/gpu_wheels.sh [DEST]        # DEST defaults to .whl; about 38 MB (a call carries 64 MiB)
#
# It needs a python3.12 (PY312=path overrides) only for pip's resolver; the wheels are cp312/manylinux.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY312=${PY312:-$(command -v python3.12 || true)}
[ -n "$PY312" ] || { echo "needs python3.12 for pip's resolver (set PY312=path)" >&2; exit 1; }
# what the GPU machine already has: never carried (a second copy would shadow it on PYTHONPATH)
PRESENT='^(numpy|grpcio|protobuf|torch|onnxruntime|uvloop|prometheus_client|nvidia_ml_py)-'
rm -rf "$DEST"
mkdir -p "$DEST"
(cd /tmp && "$PY312" -P -m pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$OLDPWD/$DEST" \
  "tritonclient[grpc,http]>=2.40" "httptools>=0.6" "hpack>=4" "h2>=4" "pyyaml>=6" \
  "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.2" "hypothesis>=6.100" "onnx>=1.15" "ml_dtypes" \
  "py-spy>=0.3")
# perf_analyzer (Triton's C++ load generator, ~7 MB): its wheel is manylinux_2_38 only; gpu_session.sh
# uses it where it runs
(cd /tmp && "$PY312" -P -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_38_x86_64 -d "$OLDPWD/$DEST" "perf-analyzer>=2.50")
for wheel in "$DEST"/*.whl; do
  if basename "$wheel" | grep -Eq "$PRESENT"; then rm -f "$wheel"; fi
done
du -sh "$DEST"
ls "$DEST"
