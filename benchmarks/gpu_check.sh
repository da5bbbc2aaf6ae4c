#!/usr/bin/env bash
# One-shot check on a GPU machine (Python 3.12, jax, torch, pytest preinstalled, no
# package index). Run from the source checkout; everything goes under $OUT:
#     OUT=/some/dir bash benchmarks/gpu_check.sh --quick   # < 8 min on an H100/H200
#     bash benchmarks/gpu_check.sh                         # the full sweeps (longer)
#     bash benchmarks/gpu_check.sh --cpu-dry-run           # every step on CPU, tiny sizes
#     bash benchmarks/gpu_check.sh --pools-only [--quick]  # just the pool comparison
# Steps, each under its own timeout (a step that fails or times out is reported in the
# summary and the rest still run; its log is $OUT/<step>.txt):
#  1) env: jax devices, torch/CUDA, nvidia-smi;
#  2) the host-copy invariant tests (tests/transfer/test_host_copies.py,
#     tests/bridge/test_torch_host_copies.py): no host memcpy on the pinned paths;
#  3) the GPU-marked kernel tests (kernels compiled for the device vs the reference);
#  4) benchmarks/kernels.py: P1 of the JAX kernels (gather/scatter vs a device copy);
#  5) benchmarks/gpu_paths.py: P1 of the vLLM worker path, P2-P4 of the JAX engine and
#     of the vLLM worker path against one large pinned copy / the per-block path;
#  6) benchmarks/pools.py: the two host pools side by side;
#  full run only: the transfer and offloader tests on the GPU, offload.py, manager.py,
#  canonical.py.
# Ends with one table (benchmarks/_gpu_table.py, also in $OUT/table.txt): P1-P4 of both
# paths with their targets (P1 >= 0.85, P2, P3 >= 0.90, P4 >= 10x). Exits non-zero if a
# step failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/benchmarks/results/gpu}"
PY="${PYTHON:-python}"
MODE=full
POOLS_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --quick) [ "$MODE" = dry ] || MODE=quick ;;
    --cpu-dry-run) MODE=dry ;;
    --pools-only) POOLS_ONLY=1 ;;
    *) echo "gpu_check.sh: unknown argument $arg (use --quick, --cpu-dry-run, --pools-only)" >&2
       exit 2 ;;
  esac
done
mkdir -p "$OUT"
if [ "$MODE" = dry ]; then
  # The same steps on CPU: every script and test runs, at sizes that take seconds.
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
fi
: > "$OUT/steps.txt"
failed=0

# step NAME SECONDS COMMAND...: runs it under a timeout, log in $OUT/NAME.txt.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name (timeout ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  local took=$((SECONDS - t0))
  tail -n 3 "$OUT/$name.txt"
  local verdict=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict="TIMED OUT after ${limit}s"
    failed=1
  elif [ "$rc" -ne 0 ]; then
    verdict="FAILED (exit $rc)"
    failed=1
  fi
  printf '%-16s %-26s %4ss\n' "$name" "$verdict" "$took" | tee -a "$OUT/steps.txt"
}

POOLS_ARGS=()
[ "$MODE" = full ] || POOLS_ARGS=(--quick)
if [ "$POOLS_ONLY" -eq 1 ]; then
  step pools 600 "$PY" benchmarks/pools.py "${POOLS_ARGS[@]}" --out "$OUT"
  cat "$OUT/pools.txt"
  exit "$failed"
fi

step env 60 "$PY" -c '
import jax, torch
print("jax", jax.__version__, jax.devices())
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/env.txt" 2>&1 || true
PLATFORM=$("$PY" -c 'import jax; print(jax.devices()[0].platform)' 2>/dev/null || echo unknown)

PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
case "$MODE" in
  dry)
    step copy_counts 300 "${PYTEST[@]}" tests/transfer/test_host_copies.py \
      tests/bridge/test_torch_host_copies.py
    step gpu_tests 120 "${PYTEST[@]}" -m gpu tests/pallas_kernels/test_gpu.py -rs
    step kernels 180 "$PY" benchmarks/kernels.py --blocks 16 --page-kib 8 --layers 1 \
      --repeats 1 --out "$OUT"
    step gpu_paths 180 "$PY" benchmarks/gpu_paths.py --cpu-dry-run --out "$OUT"
    step pools 120 "$PY" benchmarks/pools.py --quick --repeats 1 --out "$OUT"
    ;;
  quick)  # budget: 20 + 60 + 100 + 120 + 100 + 40 s of timeouts < 8 min
    step copy_counts 60 "${PYTEST[@]}" tests/transfer/test_host_copies.py \
      tests/bridge/test_torch_host_copies.py
    step gpu_tests 100 "${PYTEST[@]}" -m gpu tests/pallas_kernels/test_gpu.py -rs
    step kernels 120 "$PY" benchmarks/kernels.py --quick --out "$OUT"
    step gpu_paths 100 "$PY" benchmarks/gpu_paths.py --quick --out "$OUT"
    step pools 40 "$PY" benchmarks/pools.py --quick --out "$OUT"
    ;;
  full)
    step copy_counts 120 "${PYTEST[@]}" tests/transfer/test_host_copies.py \
      tests/bridge/test_torch_host_copies.py
    step gpu_tests 600 "${PYTEST[@]}" -m gpu tests/pallas_kernels -rs \
      --junitxml="$OUT/pytest-gpu.xml"
    step transfer_tests 900 "${PYTEST[@]}" tests/transfer tests/offloader
    step kernels 900 "$PY" benchmarks/kernels.py --out "$OUT"
    step gpu_paths 600 "$PY" benchmarks/gpu_paths.py --out "$OUT"
    step offload 900 "$PY" benchmarks/offload.py --out "$OUT"
    step manager 600 "$PY" benchmarks/manager.py --quick --out "$OUT"
    step canonical 600 "$PY" benchmarks/canonical.py --quick --out "$OUT"
    step pools 600 "$PY" benchmarks/pools.py --out "$OUT"
    ;;
esac

echo
echo "== steps ($MODE, $(date -u +%FT%TZ), $(head -1 "$OUT/env.txt" 2>/dev/null)) =="
cat "$OUT/steps.txt"
echo
echo "== P1-P4 ($PLATFORM) =="
"$PY" benchmarks/_gpu_table.py "$OUT" "$PLATFORM" | tee "$OUT/table.txt"
echo "results: $OUT"
exit "$failed"
