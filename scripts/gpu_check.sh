#!/usr/bin/env bash
# One device-tool call: build against the machine's jax, then the GPU test
# suite and a compute-sanitizer memcheck pass side by side, the grouped GEMM
# tuning (its table goes to $OUT/tuning and is used by the later steps), the
# example, and the benchmarks (cut off after BENCH_SECONDS; they save JSON
# after every case). Logs go to $OUT (or ./gpu_out when run by hand).
#   bash scripts/gpu_check.sh [build] [test] [sanitize] [tune] [example] [bench] [attn]
# Knobs: TESTS (pytest targets of `test`, default the whole suite),
# SANITIZE_FILES (test files of `sanitize`, default every file with `sanitize`
# marks), SANITIZE_TOOLS (default "memcheck"; e.g. "memcheck racecheck"),
# SANITIZE_K (a pytest -k expression narrowing the sanitize tests),
# TEST_SECONDS (interrupts the GPU pytest run after that long, default never:
# a device call cut off by its own limit brings back no summary; SIGINT lets
# pytest, with xdist too, print its counts, failures and slowest tests).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16 XLA_PYTHON_CLIENT_PREALLOCATE=false
SITE=/tmp/jax_moe_site
ROOT=$PWD
steps=" $* "; [ -z "$*" ] && steps=" build test sanitize example bench "
has() { [[ $steps == *" $1 "* ]]; }
rc=0

if has build; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
  # CUTLASS's headers (the sm90 GEMM) from the wheel carried in .whl/ (the
  # machine has no internet) unless installed. --no-deps: only its headers
  # are read. find_spec, as CMake does: the package is found, not imported.
  if ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('cutlass_library') is None)"; then
    ls .whl/nvidia_cutlass-*.whl > /dev/null 2>&1 \
      || { echo "no CUTLASS here and no .whl/nvidia_cutlass-*.whl: carry .whl (git-ignored) with the call"; exit 1; }
    python3 -m pip install -q --no-deps .whl/nvidia_cutlass-*.whl || exit 1
  fi
  start=$SECONDS
  # The sm90 GEMM is required here: without it the tile_m=256 tests would
  # only test the fallback.
  CMAKE_ARGS="${CMAKE_ARGS:-} -DJAX_MOE_ENABLE_SM90=ON" \
  python3 -m pip install -q --no-build-isolation --no-deps --target "$SITE" . > "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; exit 1; }
  echo "build: $((SECONDS - start)) s"
  PYTHONPATH=$SITE python3 -c "import jax_moe; assert jax_moe.HAS_CUDA; print('built with CUDA, sm90 GEMM:', jax_moe.HAS_SM90_GEMM)" || exit 1
fi

pids=()
if has test; then  # the whole suite, CUDA first (conftest adds the cpu backend for GPU-vs-CPU tests)
  (cd tests && PYTHONPATH=$SITE JAX_PLATFORMS=cuda timeout -s INT -k 30 "${TEST_SECONDS:-0}" \
     python3 -m pytest -q -n 8 -p no:cacheprovider --durations=15 ${TESTS:-.} \
     > "$OUT/pytest_gpu.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_gpu.log") &
  pids+=($!)
fi
if has sanitize; then  # memcheck (and SANITIZE_TOOLS) over the small edge cases marked `sanitize`
  # One driver per test file and tool (scripts/run_sanitizer.py): it survives
  # the sanitizer's occasional host-process crashes and gives each buffer its
  # own allocation so that memcheck sees its bounds.
  (cd tests
   for f in ${SANITIZE_FILES:-$(grep -l "mark.sanitize" test_*.py)}; do
     for tool in ${SANITIZE_TOOLS:-memcheck}; do
       PYTHONPATH=$SITE python3 ../scripts/run_sanitizer.py $tool "$f" "$OUT" > "$OUT/${tool}_$f.log" 2>&1
       echo "$tool $f exit $?" >> "$OUT/memcheck.log"
       tail -1 "$OUT/${tool}_$f.log" >> "$OUT/memcheck.log"
     done
   done
   grep -q "exit [^0]" "$OUT/memcheck.log" && echo "memcheck exit 1" >> "$OUT/memcheck.log" \
     || echo "memcheck exit 0" >> "$OUT/memcheck.log") &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done
for f in pytest_gpu memcheck; do
  [ -f "$OUT/$f.log" ] || continue
  echo "=== $f"; grep -E "ERROR SUMMARY|passed|failed|error|exit" "$OUT/$f.log" | tail -16
  tail -1 "$OUT/$f.log" | grep -q "exit 0" || rc=1
done

if has tune; then
  mkdir -p "$OUT/tuning"
  PYTHONPATH=$SITE timeout "${TUNE_SECONDS:-240}" python3 -m jax_moe.tune \
    --out "$OUT/tuning/$(PYTHONPATH=$SITE python3 -c 'import jax; from jax_moe import tuning; print(tuning.table_file_name(jax.devices()[0].device_kind))')" \
    ${TUNE_ARGS:-} > "$OUT/tune.log" 2>&1
  echo "=== tune (exit $?)"; tail -60 "$OUT/tune.log"
  export JAX_MOE_TUNING_DIR=$OUT/tuning
fi
if has example; then
  PYTHONPATH=$SITE python3 examples/moe_layer.py --tokens 256 > "$OUT/example.log" 2>&1 || rc=1
  echo "=== example"; tail -4 "$OUT/example.log"
fi
if has bench; then
  PYTHONPATH=$SITE timeout "${BENCH_SECONDS:-240}" python3 benchmarks/bench_moe.py \
    --json "$OUT/bench_moe.json" --plot "$OUT/bench_moe.png" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  echo "=== bench (exit $?)"; cat "$OUT/bench.log"
fi
if has attn; then
  PYTHONPATH=$SITE timeout "${ATTN_SECONDS:-180}" python3 benchmarks/bench_attention.py \
    --json "$OUT/bench_attention.json" --plot "$OUT/bench_attention.png" ${ATTN_ARGS:-} > "$OUT/bench_attention.log" 2>&1
  echo "=== attention bench (exit $?)"; cat "$OUT/bench_attention.log"
fi
exit $rc
