#!/usr/bin/env bash
# Mooncake Store for the Mooncake tier's tests (tests/tiers/*mooncake*, docs/tiers.md):
# Debian's three libraries its extension links (libibverbs1 librdmacm1 libnuma1) and the
# pinned wheel, which also ships mooncake_master and mooncake_client. Installed only if
# pip's resolution leaves torch, jax, jaxlib and numpy as they are; any failure prints a
# WARNING and the Mooncake tests skip, saying why. Run from .ci/run inside its venv.
set -uo pipefail
PIN="mooncake-transfer-engine-non-cuda==0.3.13.post1"

warn() { echo "WARNING: $*; the Mooncake tier tests skip"; exit 0; }

missing=()
for lib in libibverbs.so.1 librdmacm.so.1 libnuma.so.1; do
  ldconfig -p 2>/dev/null | grep -q "$lib" || missing+=("$lib")
done
if ((${#missing[@]})); then
  { apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 libnuma1; \
  } >/dev/null 2>&1 || warn "libibverbs1 librdmacm1 libnuma1 could not be installed (${missing[*]})"
fi

report=$(mktemp)
trap 'rm -f "$report"' EXIT
python -m pip install -q --dry-run --report "$report" "$PIN" >/dev/null 2>&1 \
  || warn "$PIN could not be resolved"
python - "$report" <<'PY' || warn "$PIN would change torch/jax/numpy"
import json, sys
touched = {p["metadata"]["name"].lower() for p in json.load(open(sys.argv[1]))["install"]}
bad = touched & {"torch", "jax", "jaxlib", "numpy"}
if bad:
    print(f"pip would install {sorted(bad)} for Mooncake", file=sys.stderr)
    raise SystemExit(1)
PY
python -m pip install -q "$PIN" || warn "$PIN could not be installed"
if ! python -c "import mooncake.store" 2>/dev/null; then
  python -m pip uninstall -q -y mooncake-transfer-engine-non-cuda >/dev/null 2>&1
  warn "$PIN does not import here"
fi
echo "Mooncake ($PIN) installed: the Mooncake tier tests will run"
