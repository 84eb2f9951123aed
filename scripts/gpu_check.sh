#!/usr/bin/env bash
# One device-tool call: build against the machine's jax, run the test suite on
# the GPU, a compute-sanitizer pass over a small GPU run, and (optionally) the
# benchmark. Logs go to $OUT (or ./gpu_out when run by hand).
#   bash scripts/gpu_check.sh [build|test|sanitize|bench|example ...]
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16
SITE=/tmp/jax_moe_site
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(build test sanitize)
rc=0
for step in "${steps[@]}"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    build)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
      python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
      python3 -m pip install -q --no-build-isolation --no-deps --target "$SITE" . > "$OUT/build.log" 2>&1 \
        || { tail -50 "$OUT/build.log"; exit 1; }
      PYTHONPATH=$SITE python3 -c "import jax_moe; assert jax_moe.HAS_CUDA; print('built with CUDA')" || exit 1
      ;;
    test)
      (cd tests && PYTHONPATH=$SITE JAX_PLATFORMS=cuda python3 -m pytest -q -x -p no:cacheprovider . 2>&1 \
        | tee "$OUT/pytest_gpu.log" | tail -30) ; rc=$((rc | PIPESTATUS[0]))
      ;;
    sanitize)
      (cd tests && PYTHONPATH=$SITE JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
        compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
        python3 -m pytest -q -p no:cacheprovider -m sanitize . > "$OUT/memcheck.log" 2>&1); s=$?
      tail -15 "$OUT/memcheck.log"; echo "memcheck exit $s"; rc=$((rc | s))
      ;;
    example)
      PYTHONPATH=$SITE python3 examples/moe_layer.py --tokens 256 2>&1 | tee "$OUT/example.log"
      ;;
    bench)
      PYTHONPATH=$SITE python3 benchmarks/bench_moe.py --json "$OUT/bench_moe.json" --plot "$OUT/bench_moe.png" \
        ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
      ;;
  esac
done
exit $rc
