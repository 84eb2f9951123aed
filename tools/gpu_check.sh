#!/usr/bin/env bash
# The GPU check, run on a machine with an NVIDIA GPU from the repository root:
#
#   bash tools/gpu_check.sh OUTDIR [STAGE ...]
#
# Always: build (pip install of this checkout with the CUDA kernels, the
# CUTLASS sm90 GEMM and the kernel benchmarks), then the GPU test suite and
# compute-sanitizer over the tests marked `sanitize`, side by side (on two
# GPUs when there are two). Optional stages, in the order given:
#   tune      the grouped GEMM tuning (its table goes to OUTDIR/tuning and is
#             used by the stages after it)
#   example   examples/moe_layer.py
#   bench     benchmarks/bench_moe.py (JSON and plot into OUTDIR)
#   attn      benchmarks/bench_attention.py
#   sharded   on all the GPUs (two or more): the sharded tests
#             (tests/layer/test_parallel.py, tests/property/test_prop_parallel.py),
#             benchmarks/bench_sharded.py forward and --train on 2, 4, ... GPUs,
#             and examples/multiprocess_moe.py with one process a GPU
#   kernels   each kernel benchmark of benchmarks/kernels, as built
# Every step logs to its own file in OUTDIR; OUTDIR/summary.txt has one line
# a step, and the exit status is 1 when any step failed.
#
# Knobs (environment): TESTS (pytest targets, default tests), TEST_SECONDS
# (interrupts the test run after that long with SIGINT, so that pytest still
# prints its summary; default no limit), SANITIZE_FILES (test files, default
# every file with `sanitize` marks), SANITIZE_TOOLS (default "memcheck"; e.g.
# "memcheck racecheck"), SANITIZE_K (a pytest -k expression narrowing the
# sanitize tests), SM90 (JAX_MOE_ENABLE_SM90, default ON: without the sm90
# GEMM the tile_m=256 tests would only test its fallback), CUTLASS_WHEEL (an
# nvidia-cutlass wheel to install first when CUTLASS's headers are missing;
# default .whl/nvidia_cutlass-*.whl if there is one), CMAKE_ARGS (added to the
# build's), TUNE_ARGS, BENCH_ARGS, ATTN_ARGS, SHARD_ARGS, and
# TUNE_SECONDS, BENCH_SECONDS, ATTN_SECONDS, SHARD_SECONDS (each sharded
# benchmark run), SHARD_TEST_SECONDS, KERNEL_SECONDS
# (time limits of those stages).
set -uo pipefail
if [ $# -lt 1 ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# NCCL without NVLink multicast (NVLS), which not every multi-GPU machine allows.
export NCCL_NVLS_ENABLE=0
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
rc=0
t0=$SECONDS

# step NAME STATUS: one line of the summary (and of the output).
step() {
  echo "$1: exit $2 ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
  [ "$2" = 0 ] || rc=1
}

# ---- build ------------------------------------------------------------------
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
has_cutlass() {
  python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('cutlass_library') is None)"
}
wheel=${CUTLASS_WHEEL:-$(ls .whl/nvidia_cutlass-*.whl 2> /dev/null | head -1)}
if ! has_cutlass && [ -n "$wheel" ]; then
  # --no-deps: only its headers are read (find_spec, as CMake does).
  python3 -m pip install -q --no-deps "$wheel" > "$OUT/cutlass.log" 2>&1
fi
build_args="-DJAX_MOE_ENABLE_SM90=${SM90:-ON} -DJAX_MOE_BUILD_KERNEL_BENCHMARKS=ON"
CMAKE_ARGS="${CMAKE_ARGS:-} $build_args" \
  python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1
status=$?
if [ $status = 0 ]; then
  (cd /tmp && python3 -c "import jax_moe; assert jax_moe.HAS_CUDA, 'no CUDA kernels'; \
print('jax_moe', jax_moe.__version__, 'CUDA: yes, sm90 GEMM:', jax_moe.HAS_SM90_GEMM)") \
    >> "$OUT/build.log" 2>&1
  status=$?
fi
step build $status
if [ $status != 0 ]; then
  tail -40 "$OUT/build.log"
  exit 1
fi
tail -1 "$OUT/build.log"

# ---- tests and sanitizers, side by side ---------------------------------------
# With two GPUs or more the tests take GPU 0 and the sanitizers GPU 1.
test_env=() sanitize_env=()
if [ "$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')" -ge 2 ]; then
  test_env=(CUDA_VISIBLE_DEVICES=0) sanitize_env=(CUDA_VISIBLE_DEVICES=1)
fi
xdist=$(python3 -c "import xdist" 2> /dev/null && echo "-n 8")
(
  env "${test_env[@]}" JAX_PLATFORMS=cuda timeout -s INT -k 30 "${TEST_SECONDS:-0}" \
    python3 -m pytest -q $xdist -p no:cacheprovider --durations=15 ${TESTS:-tests} \
    > "$OUT/pytest_gpu.log" 2>&1
  echo $? > "$OUT/.pytest_rc"
) &
test_pid=$!
(
  files=${SANITIZE_FILES:-$(grep -rl --include='test_*.py' "mark.sanitize" tests | sort)}
  src=0
  for f in $files; do
    for tool in ${SANITIZE_TOOLS:-memcheck}; do
      log=$OUT/${tool}_$(echo "$f" | tr '/' '_').log
      env "${sanitize_env[@]}" python3 tools/run_sanitizer.py "$tool" "$f" "$OUT" \
        > "$log" 2>&1
      s=$?
      echo "$tool $f: exit $s; $(tail -1 "$log")" >> "$OUT/sanitize.log"
      [ $s = 0 ] || src=1
    done
  done
  echo $src > "$OUT/.sanitize_rc"
) &
sanitize_pid=$!
wait $test_pid
step test "$(cat "$OUT/.pytest_rc")"
grep -E "passed|failed|error" "$OUT/pytest_gpu.log" | tail -3
wait $sanitize_pid
step sanitize "$(cat "$OUT/.sanitize_rc")"
cat "$OUT/sanitize.log"
rm -f "$OUT/.pytest_rc" "$OUT/.sanitize_rc"

# ---- optional stages -----------------------------------------------------------
for stage in "$@"; do
  case $stage in
    tune)
      mkdir -p "$OUT/tuning"
      table=$(python3 -c "import jax; from jax_moe import tuning; \
print(tuning.table_file_name(jax.devices()[0].device_kind))")
      timeout "${TUNE_SECONDS:-240}" python3 -m jax_moe.tune --out "$OUT/tuning/$table" \
        ${TUNE_ARGS:-} > "$OUT/tune.log" 2>&1
      step tune $?
      export JAX_MOE_TUNING_DIR=$OUT/tuning
      ;;
    example)
      python3 examples/moe_layer.py --tokens 256 > "$OUT/example.log" 2>&1
      step example $?
      ;;
    bench)
      timeout "${BENCH_SECONDS:-240}" python3 benchmarks/bench_moe.py \
        --json "$OUT/bench_moe.json" --plot "$OUT/bench_moe.png" ${BENCH_ARGS:-} \
        > "$OUT/bench_moe.log" 2>&1
      step bench $?
      ;;
    attn)
      timeout "${ATTN_SECONDS:-180}" python3 benchmarks/bench_attention.py \
        --json "$OUT/bench_attention.json" --plot "$OUT/bench_attention.png" ${ATTN_ARGS:-} \
        > "$OUT/bench_attention.log" 2>&1
      step attn $?
      ;;
    sharded)
      # All the GPUs: the sharded tests (their meshes take 8 GPUs, or 4 where
      # there are 4 to 7, else host CPU devices; the test stage above sees
      # one GPU where there are two or more), the benchmark's forward and
      # training step on 2, 4, ... of them, and the multi-process example
      # with one process a GPU.
      gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
      if [ "$gpus" -lt 2 ]; then
        echo "sharded: needs two GPUs or more, this machine has $gpus"
        step sharded 1
        continue
      fi
      counts="" n=2
      while [ "$n" -le "$gpus" ]; do counts="$counts $n"; n=$((n * 2)); done
      JAX_PLATFORMS=cuda timeout -s INT -k 30 "${SHARD_TEST_SECONDS:-600}" \
        python3 -m pytest -q -p no:cacheprovider tests/layer/test_parallel.py \
        tests/property/test_prop_parallel.py > "$OUT/pytest_sharded.log" 2>&1
      step "sharded tests ($gpus GPUs)" $?
      grep -E "passed|failed|error" "$OUT/pytest_sharded.log" | tail -1
      for mode in forward train; do
        flag=$([ $mode = train ] && echo --train)
        JAX_PLATFORMS=cuda timeout "${SHARD_SECONDS:-300}" python3 benchmarks/bench_sharded.py \
          --device-counts $counts $flag --json "$OUT/bench_sharded_$mode.json" \
          ${SHARD_ARGS:-} > "$OUT/bench_sharded_$mode.log" 2>&1
        step "sharded bench $mode" $?
      done
      timeout 300 python3 examples/multiprocess_moe.py --gpus "$gpus" --timeout 280 \
        > "$OUT/multiprocess.log" 2>&1
      step "multiprocess ($gpus GPUs)" $?
      ;;
    kernels)
      benches=$(find build -mindepth 4 -maxdepth 4 -path 'build/*/benchmarks/kernels/*' -type f \
        -executable 2> /dev/null | sort)
      [ -n "$benches" ] || { step kernels 1; echo "no kernel benchmarks under build/"; }
      for b in $benches; do
        name=$(basename "$b")
        timeout "${KERNEL_SECONDS:-120}" "$b" > "$OUT/kernel_$name.log" 2>&1
        step "kernels $name" $?
      done
      ;;
    *)
      echo "unknown stage: $stage" | tee -a "$SUMMARY"
      rc=1
      ;;
  esac
done

echo "=== summary ($OUT/summary.txt)"
cat "$SUMMARY"
exit $rc
