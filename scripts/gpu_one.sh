#!/usr/bin/env bash
# One device-tool call on one H200: build, then the GPU tests (TESTS) and the
# sanitizers (SANITIZE_FILES, SANITIZE_TOOLS) side by side, then the benches
# named in STEPS_AFTER (default "attn"; e.g. "attn bench"). At most 8 files
# come back from a call: every log goes into $OUT/logs.tgz, the JSONs beside
# it, and the summaries print.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
L=/tmp/gpu_logs; mkdir -p $L
finish() {
  cp $L/*.json "$OUT/" 2>/dev/null
  tar czf "$OUT/logs.tgz" -C $L . 2>/dev/null
}
trap finish EXIT
t0=$SECONDS
OUT=$L bash scripts/gpu_check.sh build || { tail -30 $L/build.log; exit 1; }
echo "=== build done at $((SECONDS - t0)) s"
OUT=$L bash scripts/gpu_check.sh ${STEPS_FIRST:-test sanitize}
echo "=== tests and sanitizers done at $((SECONDS - t0)) s"
grep -E "passed|failed|FAILED|Error|exit" $L/pytest_gpu.log 2>/dev/null | tail -25
cat $L/memcheck.log 2>/dev/null
grep -lE "Invalid|out of bounds|Segmentation|Fatal|Race reported|hazard" $L/memcheck_*.log $L/racecheck_*.log 2>/dev/null \
  | while read f; do echo "--- $f"; grep -E -B2 -A12 "Invalid|Segmentation|Fatal|Race|hazard" "$f" | head -60; done
if [ -n "${PROFILE_LAYER:-}" ]; then  # e.g. PROFILE_LAYER="qwen3_30b_a3b:1 mixtral_8x7b:16"
  for c in $PROFILE_LAYER; do
    PYTHONPATH=/tmp/jax_moe_site timeout 120 python3 scripts/profile_layer.py ${c%:*} ${c#*:} 20 \
      > $L/profile_${c%:*}_${c#*:}.txt 2>&1
    echo "=== profile $c (exit $?)"; grep -vE "^[WE][0-9]{4} " $L/profile_${c%:*}_${c#*:}.txt | tail -40
  done
fi
for step in ${STEPS_AFTER:-attn}; do
  OUT=$L bash scripts/gpu_check.sh $step > $L/step_$step.txt 2>&1
  echo "=== $step done at $((SECONDS - t0)) s"
  grep -vE "^[WE][0-9]{4} |bfc_alloc" $L/step_$step.txt | tail -45
done
if [ -n "${PROFILE_DECODE:-}" ]; then  # e.g. PROFILE_DECODE="64 4096"
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
  PYTHONPATH=/tmp/jax_moe_site timeout 240 $NCU --kernel-name regex:DecodeSplit --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,dram__bytes_read.sum" \
    python3 scripts/profile_decode.py $PROFILE_DECODE > $L/ncu_decode.txt 2>&1
  echo "=== ncu decode (exit $?)"; grep -vE "^[WE][0-9]{4} " $L/ncu_decode.txt | tail -120
fi
if [ -n "${PREFILL_HLO:-}" ]; then  # e.g. PREFILL_HLO="1 4096": copies around fill_rows?
  PYTHONPATH=/tmp/jax_moe_site timeout 120 python3 scripts/prefill_hlo.py $PREFILL_HLO > $L/prefill_hlo.txt 2>&1
  echo "=== prefill HLO (exit $?)"; grep -vE "^[WE][0-9]{4} " $L/prefill_hlo.txt | tail -40
fi
