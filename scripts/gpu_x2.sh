#!/usr/bin/env bash
# One device-tool call on a 2-GPU machine (nvidia-h200-x2), everything in
# parallel where the GPUs allow it:
#   GPU 0: the test suite, memcheck over the `sanitize` cases, the attention bench
#   GPU 1: the MoE layer bench (bench_moe.py, full grid)
#   then both: the sharded bench (bench_sharded.py) and the one-process-per-GPU
#   example. Logs under $OUT. NVLink multicast stays off (the machine's rule).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SITE=/tmp/jax_moe_site
bash scripts/gpu_check.sh build || exit 1
t0=$SECONDS
( export CUDA_VISIBLE_DEVICES=0
  bash scripts/gpu_check.sh test sanitize > "$OUT/gpu0_checks.txt" 2>&1
  ATTN_SECONDS=${ATTN_SECONDS:-150} bash scripts/gpu_check.sh attn > "$OUT/gpu0_attn.txt" 2>&1
  echo "gpu0 done at $((SECONDS - t0)) s" >> "$OUT/gpu0_checks.txt" ) &
( export CUDA_VISIBLE_DEVICES=1
  BENCH_SECONDS=${BENCH_SECONDS:-330} bash scripts/gpu_check.sh bench > "$OUT/gpu1_bench.txt" 2>&1
  echo "gpu1 done at $((SECONDS - t0)) s" >> "$OUT/gpu1_bench.txt" ) &
wait
echo "=== single-GPU phase: $((SECONDS - t0)) s"
grep -E "passed|failed|ERROR SUMMARY|exit|done at" "$OUT/gpu0_checks.txt" | tail -8
JAX_PLATFORMS=cuda PYTHONPATH=$SITE timeout "${SHARD_SECONDS:-150}" python3 benchmarks/bench_sharded.py \
  ${SHARD_ARGS:-} --json "$OUT/bench_sharded.json" > "$OUT/bench_sharded.log" 2>&1
echo "=== bench_sharded (exit $?)"; cat "$OUT/bench_sharded.log" | tail -40
PYTHONPATH=$SITE timeout 90 python3 examples/multiprocess_moe.py --gpus 2 --timeout 80 > "$OUT/multiprocess.log" 2>&1
echo "=== multiprocess --gpus 2 (exit $?)"; tail -12 "$OUT/multiprocess.log"
echo "=== bench_moe"; cat "$OUT/gpu1_bench.txt"
echo "=== attention"; tail -30 "$OUT/gpu0_attn.txt"
