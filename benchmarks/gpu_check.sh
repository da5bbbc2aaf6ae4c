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
# 4) the two host pools side by side (numpy rows vs the pinned_host arrays themselves),
# then a short table last. Exits non-zero if the tests fail.
#     bash benchmarks/gpu_check.sh --pools-only --quick   # just the pool comparison
#                                                          # (runs on a CPU too)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/benchmarks/results/gpu}"
mkdir -p "$OUT"
POOLS_ARGS=()
if [ "${1:-}" = "--pools-only" ]; then
  shift
  [ "${1:-}" = "--quick" ] && POOLS_ARGS=(--quick) && shift
  python benchmarks/pools.py "${POOLS_ARGS[@]}" --out "$OUT" "$@" 2>&1 | tee "$OUT/pools.txt"
  exit "${PIPESTATUS[0]}"
fi

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
# The two host pools side by side: numpy rows (a host copy per store) vs pinned rows.
python benchmarks/pools.py "${POOLS_ARGS[@]}" --out "$OUT" 2>&1 | tee "$OUT/pools.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1

echo
echo "== summary ($(date -u +%F), $(head -1 "$OUT/env.txt")) =="
tail -1 "$OUT/pytest-gpu.txt"
python - "$OUT/kernels.csv" "$OUT/offload.csv" <<'PY'
import csv, os, sys
if os.path.exists(sys.argv[1]):
    print(f"{'backend':>10} {'L':>3} {'KiB':>4} {'blocks':>6} {'gather GiB/s':>12} {'/copy':>6} "
          f"{'scatter GiB/s':>13} {'/copy':>6}   (target: /copy >= 0.85 at >= 16 KiB, >= 256 blocks)")
    for r in csv.DictReader(open(sys.argv[1])):
        if int(r["blocks"]) >= 256 and int(r["page_kib"]) >= 16 or int(r["blocks"]) == 16:
            print(f"{r['backend']:>10} {r['layers']:>3} {r['page_kib']:>4} {r['blocks']:>6} "
                  f"{float(r['gather_gibps']):>12.1f} {float(r['gather_vs_copy']):>6.2f} "
                  f"{float(r['scatter_gibps']):>13.1f} {float(r['scatter_vs_copy']):>6.2f}")
if os.path.exists(sys.argv[2]):
    print(f"{'L':>3} {'KiB':>4} {'blocks':>6} {'store/copy':>10} {'store/per-block':>15} "
          f"{'load/copy':>9} {'load/per-block':>14}   (targets: 0.9, 10x)")
    for r in csv.DictReader(open(sys.argv[2])):
        print(f"{r['layers']:>3} {r['page_kib']:>4} {r['blocks']:>6} "
              f"{float(r['store_vs_ceiling']):>10.2f} {float(r['store_vs_per_block']):>15.1f} "
              f"{float(r['load_vs_ceiling']):>9.2f} {float(r['load_vs_per_block']):>14.1f}")
PY
tail -1 "$OUT/pytest-transfer.txt"
echo "results: $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
