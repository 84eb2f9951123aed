#!/usr/bin/env bash
# One device-tool call on a 2-GPU machine (nvidia-h200-x2):
#   GPU 0: the test suite, then the attention bench (ATTN=0 skips it)
#   GPU 1: memcheck over the `sanitize` cases, then the MoE layer bench (BENCH_ARGS)
#   then both (SHARDED=0 skips): the sharded bench and one process per GPU.
# At most 8 files come back from a call: every log goes into $OUT/logs.tgz,
# the benchmark JSONs beside it, and the summaries print. NVLink multicast
# stays off (the machine's rule).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SITE=/tmp/jax_moe_site
L=/tmp/gpu_logs; mkdir -p $L
finish() {
  cp $L/*.json "$OUT/" 2>/dev/null
  tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null
}
trap finish EXIT
OUT=$L bash scripts/gpu_check.sh build || { tail -30 $L/build.log; exit 1; }
t0=$SECONDS
( export CUDA_VISIBLE_DEVICES=0 OUT=$L
  bash scripts/gpu_check.sh test > $L/gpu0.txt 2>&1
  [ "${ATTN:-1}" = 0 ] || ATTN_SECONDS=${ATTN_SECONDS:-150} bash scripts/gpu_check.sh attn >> $L/gpu0.txt 2>&1
  echo "gpu0 done at $((SECONDS - t0)) s" >> $L/gpu0.txt ) &
( export CUDA_VISIBLE_DEVICES=1 OUT=$L
  bash scripts/gpu_check.sh sanitize > $L/gpu1.txt 2>&1
  BENCH_SECONDS=${BENCH_SECONDS:-300} bash scripts/gpu_check.sh bench >> $L/gpu1.txt 2>&1
  echo "gpu1 done at $((SECONDS - t0)) s" >> $L/gpu1.txt ) &
wait
echo "=== single-GPU phase: $((SECONDS - t0)) s"
echo "=== tests (GPU 0)"; grep -E "passed|failed|FAILED|exit" $L/pytest_gpu.log | tail -20
echo "=== memcheck (GPU 1)"; cat $L/memcheck.log
grep -lE "Invalid|out of bounds|Segmentation|Fatal" $L/memcheck_*.log 2>/dev/null | while read f; do
  echo "--- $f"; grep -E -B2 -A12 "Invalid|Segmentation|Fatal" "$f" | head -60; done
echo "=== bench (GPU 1)"; grep -vE "^[WE][0-9]{4} |bfc_alloc" $L/bench.log | head -40
[ "${ATTN:-1}" = 0 ] || { echo "=== attention"; tail -30 $L/bench_attention.log; }
if [ "${SHARDED:-1}" != 0 ]; then
  JAX_PLATFORMS=cuda PYTHONPATH=$SITE timeout "${SHARD_SECONDS:-150}" python3 benchmarks/bench_sharded.py \
    ${SHARD_ARGS:-} --json $L/bench_sharded.json > $L/bench_sharded.log 2>&1
  echo "=== bench_sharded (exit $?)"; tail -40 $L/bench_sharded.log
  PYTHONPATH=$SITE timeout 90 python3 examples/multiprocess_moe.py --gpus 2 --timeout 80 > $L/multiprocess.log 2>&1
  echo "=== multiprocess --gpus 2 (exit $?)"; tail -12 $L/multiprocess.log
fi
