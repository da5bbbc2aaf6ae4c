#!/usr/bin/env bash
# One-shot check on a GPU machine (Python 3.12, jax 0.11.x, flax, chex, torch, pytest
# preinstalled, no package index). Run from the source checkout:
#     bash benchmarks/gpu_check.sh            # results under benchmarks/results/gpu
#     OUT=/some/dir bash benchmarks/gpu_check.sh
# 1) the GPU-marked tests (kernels compiled for the device vs the reference, in place),
#    and the transfer engine / KVOffloader tests on the GPU (the default device there),
# 2) the kernel benchmark (every GPU backend vs XLA vs a device-to-device copy),
# 3) the offload benchmark (engine vs per-block path vs one large device_put), the
#    scheduler-side manager benchmark and the canonical-vs-direct benchmark (real D2H),
# then a short table last. Exits non-zero if the tests fail.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/benchmarks/results/gpu}"
mkdir -p "$OUT"

python -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/env.txt" 2>&1 || true

python -m pytest -m gpu tests/pallas_kernels -q -rs -p no:cacheprovider \
  --junitxml="$OUT/pytest-gpu.xml" 2>&1 | tee "$OUT/pytest-gpu.txt"
tests_rc=${PIPESTATUS[0]}
python -m pytest tests/transfer tests/test_offloader.py -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/pytest-transfer.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || tests_rc=1

python benchmarks/kernels.py --out "$OUT" "$@" 2>&1 | tee "$OUT/kernels.txt"
bench_rc=${PIPESTATUS[0]}
python benchmarks/offload.py --out "$OUT" 2>&1 | tee "$OUT/offload.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
python benchmarks/manager.py --quick --out "$OUT" 2>&1 | tee "$OUT/manager.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
python benchmarks/canonical.py --quick --out "$OUT" 2>&1 | tee "$OUT/canonical.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1

echo
echo "== summary ($(date -u +%F), $(head -1 "$OUT/env.txt")) =="
tail -1 "$OUT/pytest-gpu.txt"
python - "$OUT/kernels.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print(f"{'backend':>10} {'L':>3} {'KiB':>4} {'blocks':>6} {'gather GB/s':>11} {'x copy':>6} "
      f"{'scatter GB/s':>12} {'x copy':>6}")
for r in rows:
    if int(r["blocks"]) >= 256 and int(r["page_kib"]) >= 16 or int(r["blocks"]) == 16:
        print(f"{r['backend']:>10} {r['layers']:>3} {r['page_kib']:>4} {r['blocks']:>6} "
              f"{float(r['gather_gbps']):>11.1f} {float(r['gather_vs_copy']):>6.2f} "
              f"{float(r['scatter_gbps']):>12.1f} {float(r['scatter_vs_copy']):>6.2f}")
PY
tail -1 "$OUT/pytest-transfer.txt"
tail -n 4 "$OUT/offload.txt"
echo "results: $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
