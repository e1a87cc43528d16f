#!/usr/bin/env bash
# Everything the GPU machine checks and times, in one call (device time is scarce):
#   scripts/device_check.sh [STEP ...]      (default: all steps; results and logs under $OUT)
# Steps: kernel_tests, fp8, gdn, attention, step, spec, bench27 (the 27B FP8 table on one GPU),
#        bench27_tp2 (the same at TP2: run on nvidia-h200-x2), collectives.
# Each step has its own time limit so a slow one cannot eat the others; every log ends with rc=N.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_PLATFORMS=cuda
OUT=${OUT:-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(kernel_tests fp8 gdn attention step spec)

run_step() {  # name limit_s command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "rc=$?" >>"$OUT/$name.log"
  tail -n 4 "$OUT/$name.log" | cut -c1-300
}

bench() {  # part limit_s [flags...]
  local part=$1 limit=$2
  shift 2
  run_step "bench_$part" "$limit" python3 -m pallas_kernels.bench --parts="$part" --out="$OUT/bench_$part.json" "$@"
}

for s in "${steps[@]}"; do
  case $s in
    kernel_tests) run_step kernel_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
                    tests/test_kernel_fp8_matmul.py tests/test_kernel_gdn.py tests/test_kernel_paged_attention.py ;;
    fp8) bench fp8 240 ;;
    gdn) bench gdn 150 ;;
    attention) bench attention 150 ;;
    step) bench step 300 --step_impls=pallas,pallas_m1fma,ref ;;
    spec) run_step spec 300 python3 scripts/gpu_spec.py --impl=pallas --cases=q35_27b_controlled_fp8 \
            --out="$OUT/spec.json" ;;
    bench27) run_step bench27 560 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --repeats=2 \
               --out="$OUT/bench27_tp1.json" --converted_cache=/tmp/qmtp_conv ;;
    bench27_tp2) run_step bench27_tp2 560 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp2.flags \
                   --repeats=2 --out="$OUT/bench27_tp2.json" --converted_cache=/tmp/qmtp_conv ;;
    collectives) run_step collectives 120 env JAX_PLATFORMS=cpu python3 scripts/tp_collectives.py ;;
    *) echo "unknown step $s (kernel_tests fp8 gdn attention step spec bench27 bench27_tp2 collectives)"; exit 2 ;;
  esac
done
