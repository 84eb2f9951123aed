#!/usr/bin/env bash
# Verification call on nvidia-h200-x2: GPU 0 runs the test suite, GPU 1 the
# memcheck pass and then a few layer-benchmark cases (BENCH_ARGS). At most 8
# files come back, so every log goes into logs.tgz; summaries print.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=/tmp/gpu_logs; mkdir -p $L
OUT=$L bash scripts/gpu_check.sh build || { tail -30 $L/build.log; exit 1; }
( CUDA_VISIBLE_DEVICES=0 OUT=$L bash scripts/gpu_check.sh test > $L/gpu0.txt 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  OUT=$L bash scripts/gpu_check.sh sanitize > $L/gpu1.txt 2>&1
  OUT=$L BENCH_SECONDS=${BENCH_SECONDS:-120} bash scripts/gpu_check.sh bench >> $L/gpu1.txt 2>&1 ) &
wait
echo "=== tests (GPU 0)"; grep -E "passed|failed|FAILED|exit" $L/pytest_gpu.log | tail -20
echo "=== memcheck (GPU 1)"; cat $L/memcheck.log
grep -lE "Invalid|out of bounds|Segmentation|Fatal" $L/memcheck_*.log | while read f; do
  echo "--- $f"; grep -E -B2 -A12 "Invalid|Segmentation|Fatal" "$f" | head -60; done
echo "=== bench (GPU 1)"; grep -vE "^[WE]1129|bfc_alloc" $L/bench.log | head -40
cp $L/bench_moe.json "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null
