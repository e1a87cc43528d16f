#!/usr/bin/env bash
# Everything the GPU machine checks and times, in one call (device time is scarce):
#   scripts/device_check.sh [STEP ...]      (default: all steps; results and logs under $OUT)
# Steps: kernel_tests, bench_fp8, bench_gdn, bench_attention, layout, spec.
# Each step has its own time limit so a slow one cannot eat the others; every log ends with rc=N.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_PLATFORMS=cuda
OUT=${OUT:-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(kernel_tests bench_fp8 bench_gdn bench_attention layout spec)

run_step() {  # name limit_s command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$?" >>"$OUT/$name.log"
  tail -n 4 "$OUT/$name.log" | cut -c1-300
}

for s in "${steps[@]}"; do
  case $s in
    kernel_tests) run_step kernel_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
                    tests/test_kernel_fp8_matmul.py tests/test_kernel_gdn.py tests/test_kernel_paged_attention.py ;;
    bench_fp8) run_step bench_fp8 150 python3 scripts/bench_fp8_matmul.py --out="$OUT/bench_fp8.json" ;;
    bench_gdn) run_step bench_gdn 150 python3 scripts/bench_gdn.py --out="$OUT/bench_gdn.json" ;;
    bench_attention) run_step bench_attention 150 python3 scripts/bench_paged_attention.py ;;
    layout) run_step layout 60 python3 scripts/gpu_layout_probe.py ;;
    spec) run_step spec 300 python3 scripts/gpu_spec.py --impl=pallas --cases=q35_27b_controlled_fp8 \
            --out="$OUT/spec.json" ;;
    *) echo "unknown step $s (kernel_tests bench_fp8 bench_gdn bench_attention layout spec)"; exit 2 ;;
  esac
done
