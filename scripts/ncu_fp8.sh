#!/usr/bin/env bash
# Nsight Compute on the FP8 decode kernel (scripts/ncu_fp8.py): where does it stall? On the GPU
# machine, from the repository root, one call:
#   bash scripts/ncu_fp8.sh            -> $OUT/ncu_sections.txt (throughput, occupancy, warp states)
#                                         $OUT/ncu_source_up.csv (SASS of the gate/up launch with stall samples)
# ncu runs with --clock-control none (leave the card's clocks alone).
set -u
OUT=${NCU_OUT:-$OUT}  # gpu_session.sh passes its results folder
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
export PYTHONPATH=. JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_enable_command_buffer=
common=(--clock-control none -k regex:fp8_matmul_decode --launch-skip 4)
timeout ${NCU_T1:-90} "$NCU" "${common[@]}" --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  python3 scripts/ncu_fp8.py >"$OUT/ncu_sections.txt" 2>&1
echo "sections rc=$?"
timeout ${NCU_T2:-70} "$NCU" "${common[@]}" --launch-count 1 --section SourceCounters --page source --print-source sass \
  --csv python3 scripts/ncu_fp8.py >"$OUT/ncu_source_up.csv" 2>&1
echo "source rc=$?"
grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Shared Memory Config|Warp Cycles Per Issued|Stall|Block Size|Grid Size|Waves Per SM" "$OUT/ncu_sections.txt" | head -80
