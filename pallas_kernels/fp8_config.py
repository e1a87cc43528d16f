"""The heuristics that choose the FP8 block matmul kernels' tile configuration per (M, O, I)
(pallas_kernels/fp8_matmul.py; the configs themselves and their limits: fp8_tiles.py), with the
module switches the measurements set.

The switches (M1_CUDA_CORE, SCALE_PRELOAD, X_F16, X_F16_MAX_ROWS, X_F16_SCALED, X_CHUNK_SCALED,
NARROW_X_ON_M, NARROW_NUM_STAGES, DECODE_MAX_ROWS, GEMM_SPLIT_PROGRAMS, NARROW_DECODE_MAX_ROWS,
GEMM_X_F16_SCALED, the VERIFY_* tiles) live here and only here: set them through
`qmtp.ops.set_kernel_settings` (or `--kernels`), never on a module that imported them.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.fp8_tiles import BLOCK, DECODE_DOT_MAX_ROWS, DOT_MIN, DecodeConfig, PrefillConfig, cdiv

SM_COUNT = 132  # H200 streaming multiprocessors (the split-K heuristic's occupancy target)

# M above this runs the prefill GEMM (default_config's dispatch): every launch of at most 64 rows (decode,
# a verify of up to 16 slots x K+1 = 4) streams its weights on the decode grid. History: 32 since
# 2026-11-30, when a batch-8 verify (32 rows) on the GEMM tiles gave narrow weights few programs
# (mlp_down [5120, 17408] at BN = 128: 40 on 132 SMs) and the decode grid streamed 1.25-1.78 TB/s per
# 27B weight against 0.50-1.14 (`pallas_kernels.bench --parts=fp8 --fp8_ms=32 --fp8_sweep`). 64 since
# session 20, once the launch bench timed every weight of a GEMM launch (session 19's fix) and the
# 33-64-row decode grid ran 3 stages: on the H200 (`scripts/gpu_session.sh start_stages64`, one lease,
# copy 3.77 TB/s) the FP8 launches of a 27B step by kernel time at 40 / 48 / 64 rows took 16.2 / 16.3 /
# 16.7 ms with the wide launches on the GEMM against 11.7 / 12.5 / 13.4 on the decode grid
# (gate + up 135 -> 95 us at 64 rows, q + k + v 55 -> 41, in_proj 59 -> 48); batch 16, K=3 (64-row
# verifies): natural 2431 -> 2557 tok/s, profiled 1872 -> 1959, plain 1313 / 1306, tokens equal plain.
# 128 (DECODE_DOT_MAX_ROWS, the decode kernel's limit) since session 21: a verify of 17-32 slots at K=3
# on the decode grid with VERIFY_TALL_STAGES. On the H200 (`scripts/gpu_session.sh start_tall2`, one
# lease, copy 3.68-3.81 TB/s) the FP8 launches of a 27B step by kernel time at 96 / 128 rows took
# 32.1 / 31.5 ms on the GEMM against 23.4 / 22.2 on the decode grid; batch 32, K=3 (128-row verifies):
# natural 2720 -> 3048 tok/s, profiled 2070 -> 2335 (session 20's GEMM run against session 21's, one
# process each), plain 1952 / 1926, tokens equal plain.
DECODE_MAX_ROWS = 128
# True: one row of a wide weight takes the CUDA-core (FMA) path; False: every M <= DECODE_MAX_ROWS
# takes the tensor-core configuration. Measured in the 64-layer 27B step on the H200 (2026-11-30,
# `python -m pallas_kernels.bench --parts=step --step_impls=pallas,pallas_m1fma`): 12.93 ms with
# the tensor-core path vs 14.27 ms with the FMA path, though the isolated per-weight sweeps had
# favoured FMA. The module switch keeps the other path measurable (step variant "pallas_m1fma").
# With it off, a row's result also no longer depends on whether it is decoded alone or with others
# in a verify pass of <= 16 rows (one tile configuration, one reduction order; 17-32 rows use split-K 4).
M1_CUDA_CORE = False
# True: default decode configs of up to 16 rows preload their block scales (DecodeConfig.scale_preload).
# Measured in the 64-layer 27B step on the H200 (2026-11-30, `pallas_kernels.bench --parts=step`):
# 12.70 ms with preloaded scales vs 12.90 ms without (step variant "pallas_nopreload" keeps the old
# path measurable); per weight at 1-16 rows it was within +-7% either way.
SCALE_PRELOAD = True
# True: default tensor-core decode configs take bf16 x as two f16 pieces (DecodeConfig.x_f16), so
# each FP8 weight converts E4M3 -> f16 once (one instruction per two weights) instead of
# E4M3 -> f16 -> bf16. The kernel was conversion-bound: it streamed bf16 weights at 2.5-3.5 TB/s but
# FP8 weights at only 1.3-2.1 (H200, per weight at M = 1-16); its loop had 312 PTX instructions per
# 64 x 128 chunk, 96 of them conversions, against 184 with x_f16 (Triton 3.9 offline compile for
# sm_90, scripts/triton_loop_stats.py). Measured in the 64-layer 27B step on the H200 (2026-11-30,
# `pallas_kernels.bench --parts=step`): 10.37 ms with x_f16 vs 12.75 ms without (step variant
# "pallas_noxf16" keeps the old path measurable); the FP8 kernels' share fell from 10.7 to 8.0 ms.
X_F16 = True
# The most rows that take x_f16 by default (their 2M piece rows pad the dot to 2M, not 16). 16: at
# 9-16 rows the pieces fill a 32-row dot and each weight still converts once to f16, not to bf16;
# measured per weight at M = 16 on the H200 (2026-11-30, session 9, `pallas_kernels.bench
# --parts=fp8 --fp8_ms=1,4,16`, the default with x_f16 flipped): faster on all seven 27B shapes,
# 5120x6144 24.7 -> 20.7 us, 5120x17408 54.7 -> 45.2, 17408x5120 44.2 -> 39.5, 12288x5120
# 28.2 -> 25.3, 10240x5120 28.7 -> 26.1, 6144x5120 20.9 -> 19.5. At M = 32 (64 piece rows) it ran
# 1.2-1.4x slower on every shape (session 6): 17-32 rows stay on bf16 x.
X_F16_MAX_ROWS = 16
# Programs per SM the few-row split-K heuristic aims for (split_k doubles, up to 8 and while each split
# keeps >= 4 chunks, until the grid has this many programs per SM). 2: the narrow weights (mlp_down,
# o_proj / out_proj: 80 row blocks) get split-K 4, 320 programs of 4 warps on 132 SMs. Nsight Compute
# on them (H200, 2026-11-30): 15% achieved occupancy, 7.1 cycles per issued instruction, 1.8 TB/s:
# latency-bound with few warps in flight; the wide weights (8 programs per SM) stream ~3.4 TB/s with
# x_f16. 4 doubles the narrow grids (step variant "pallas_pps4"); off until the step measures it.
DECODE_PROGRAMS_PER_SM = 2
# True: with x_f16, a narrow FP8 launch (fewer 64-row blocks than SMs in its summed O: mlp_down and
# o_proj / out_proj in the 27B step; at TP2 also in_proj_qkv + z and q + k + v, which share launches)
# puts x's piece rows on the dot's M side (swap_ab=False, as the wide weights do) and
# splits K until the grid has NARROW_PROGRAMS_PER_SM programs per SM (split-K 8 on the 27B shapes).
# False: W on the M side and DECODE_PROGRAMS_PER_SM (split-K 4), the policy chosen before x_f16.
# Measured per weight at M = 1 on the H200 (2026-11-30, `pallas_kernels.bench --parts=fp8 --fp8_ms=1
# --fp8_sweep --fp8_sweep_match=x_f16=True`): mlp_down [5120, 17408] 42.5 -> 29.2 us (2.1 -> 3.1
# TB/s), o_proj / out_proj [5120, 6144] 17.5 -> 13.4 us, in_proj_z [6144, 5120] 17.5 -> 14.2 us;
# split-K 4 with x on M was 1-8% slower than 8 on each. The wide weights' best stayed split-K 2.
# In the 64-layer step, same run: 9.52 ms against 10.65 ms with False (step variant "pallas_narrow_wm").
NARROW_X_ON_M = True
NARROW_PROGRAMS_PER_SM = 4
# Pipeline stages of the narrow x-on-M launches (o_proj / out_proj, mlp_down). Their programs are
# short (6 chunks of 128 columns each for [5120, 6144] at split-K 8): with fewer loads in its
# prologue a program waits less before its first chunk. Not occupancy: 60 registers and 24 KB (3
# stages) or 36 KB (4) of shared memory per program fit 8 or 6 programs per SM, and o_proj's 640
# programs run in one wave either way (scripts/triton_loop_stats.py, cases oproj_*). Measured on the H200 (2026-12-01, session 15): the o_proj
# sweep (`pallas_kernels.bench --parts=fp8 --fp8_shapes=5120x6144 --fp8_sweep`) had 3 stages fastest
# at 16 rows (14.2 against 16.3 us per call) and at 1 row (14.0 against 14.3); the step's launches by
# kernel time (`--parts=fp8_launches --kernels=fp8_narrow_num_stages=4|3|2`) at 1 / 4 / 16 rows:
# o_proj 11.17 / 11.47 / 11.93 us with 4 stages, 10.62 / 10.92 / 11.20 with 3, 12.08 / 12.49 / 12.72
# with 2; mlp_down 25.41 / 25.85 / 26.64, 24.44 / 24.82 / 25.44, 28.32 / 28.98 / 29.52; all FP8
# launches of a step 7.21 / 7.34 / 7.36 ms with 4, 7.13 / 7.26 / 7.22 with 3. The 64-layer step: 9.20
# ms either way (9.204 / 9.197, within its run-to-run spread). The wide launches keep 4.
NARROW_NUM_STAGES = 3
# True: default decode configs of 9-32 rows (a verify of several slots) take bf16 x as one f16 piece
# per row scaled by a power of two (DecodeConfig.x_f16_scaled), not as two pieces (9-16 rows) or bf16
# (17-32 rows). Why: at 16 rows the two pieces fill a 32-row dot, and the kernel is instruction-bound:
# 234 PTX instructions per 64 x 128 chunk (32 mma.sync) against 183 at 4 rows (16 mma.sync; Triton
# 3.9 for sm_90, scripts/triton_loop_stats.py cases up_m16 / up_m4_x_f16). Measured on the H200
# (2026-12-01, session 15, `scripts/gpu_session.sh start_rows`): the step's FP8 launches at 16 rows
# stream at 86% of copy by kernel time against 70% with two pieces (`pallas_kernels.bench
# --parts=fp8_launches`), and every 27B shape is faster per call at 16 and 32 rows (5120x6144
# 20.9 -> 15.8 us at 16, 25.0 -> 20.6 at 32); batch 4 with K=3 end to end (16-row verifies): natural
# 1066 -> 1197 tok/s, profiled 822 -> 921 (`qmtp.bench --batch=4 --ks=3`), plain unchanged (406 / 407).
# The row max it needs before the kernel costs less than the halved dot saves.
X_F16_SCALED = True
X_F16_SCALED_MIN_ROWS = DOT_MIN // 2 + 1  # below it, two pieces per row still fit the dot's 16-row minimum
# True: default tensor-core decode configs take bf16 x as it is and make the scaled f16 piece inside the
# kernel, per row and chunk (DecodeConfig.x_chunk_scaled), at every row count, instead of x_f16's
# pieces made by XLA before each FP8 launch. Why: in the 27B step's optimized HLO (session 16) XLA
# fuses most pieces into a launch the step needs anyway (the norm, silu(gate) * up), but 112 launches
# per step do nothing else (o_proj's and out_proj's x, and the GDN layers' normalized x, which
# in_proj_b/a also read): ~1.1-2 us each on the chain, 0.12-0.22 ms per step, against a heavier
# chunk loop (277 PTX instructions against 180). Measured slower on the H200 (session 18,
# `scripts/gpu_session.sh start_xchunk`): the 64-layer step 9.07 -> 10.01 ms (`--parts=step`, variant
# "pallas_untiled_xchunk" against "pallas_untiled"), the step's FP8 launches by kernel time 6.97 -> 8.01 ms
# at 1 row (o_proj 10.5 -> 12.5 us), by busy time with the XLA pieces 7.15 -> 8.13 ms, TP1 plain decode
# 111.7 -> 102.1 tok/s: the loop's extra instructions cost more than the launches it removes. Kept, off,
# as the measured alternative (step variant "pallas_xchunk").
X_CHUNK_SCALED = False
# The GEMM (more than DECODE_MAX_ROWS rows) splits I until its grid has this many programs (0: never).
# Why: a batched verify of 64 rows (16 slots x K + 1 = 4) on whole 64 x 128 output tiles gave the
# narrow weights one program per 128 output rows and nothing else: o_proj / out_proj and mlp_down 40
# programs on 132 SMs, k_proj / v_proj 8. Measured on the H200 before the split (session 18,
# `pallas_kernels.bench --parts=fp8_launches --fp8_launch_ms=64`): the FP8 launches of a 27B step 29.4
# ms at 64 rows (GEMM groups by their first weight, NARROW_DECODE_MAX_ROWS's caveat; o_proj 86.9 us,
# mlp_down 245 us) against 7.2 ms at 16 rows.
GEMM_SPLIT_PROGRAMS = SM_COUNT
# A narrow launch (fewer 64-row blocks than SMs in its summed O: o_proj / out_proj, mlp_down in the 27B
# step) of more than DECODE_MAX_ROWS rows runs on the decode grid up to this many rows, not the GEMM
# (<= DECODE_MAX_ROWS: off; at most DECODE_DOT_MAX_ROWS). Since DECODE_MAX_ROWS is 64 (session 20, 128
# since session 21) it matters only where fp8_decode_max_rows is set lower. Measured per launch on the H200 (session 18,
# `pallas_kernels.bench --parts=fp8_launches --fp8_launch_ms=48,64`, the GEMM split along I against the
# decode grid), busy time per call with the XLA pieces and sums, at 48 / 64 rows: mlp_down 77.5 / 72.7
# us on the GEMM against 59.6 / 67.5 on the decode grid, o_proj 30.6 / 29.5 against 25.4 / 27.0,
# out_proj 30.5 / 29.6 against 25.1 / 26.7. (The wide launches' "faster on the GEMM" of that run timed a
# GEMM launch of several weights by its first weight alone, a bench fault fixed in session 19;
# re-timed, they are faster on the decode grid: DECODE_MAX_ROWS.)
NARROW_DECODE_MAX_ROWS = 64
# The decode grid at 33-64 rows (VERIFY_NARROW_MIN_ROWS: a batched verify of 9-16 slots at K=3) runs
# this pipeline depth, and split-K 8 where each run keeps >= 16 chunks (4 otherwise). Why: at 64 rows a
# stage holds the [64, 128] FP8 weight chunk and the [64, 128] f16 x slice, 24 KB: 4 stages left room
# for 2 programs per SM, 3 stages for 3. Measured on the H200 (session 19, `scripts/gpu_session.sh
# start_narrow`: the 64-row sweep, checkpoint layout, one run at copy 3.73 TB/s), wall time per call
# with the x piece and the split-K sum, the 4-stage split-4 default against the best: o_proj / out_proj
# 31.4 -> 25.9 us (split 4, 3 stages; split 8 26.6), mlp_down 73.0 -> 56.0 (split 8, 3 stages; split 4
# 58.5). Per step (session 20, `start_stages64`, the launches by kernel time with the wide ones still on
# the GEMM): 4 stages 16.9 / 17.3 / 17.6 ms at 40 / 48 / 64 rows against 16.2 / 16.3 / 16.7 with 3
# (o_proj 26.1 -> 19.7 us, mlp_down 56.2 -> 48.7 at 64 rows). 17-32 rows keep the 4-stage config they
# were measured with.
VERIFY_NARROW_STAGES = 3  # ops setting fp8_verify_narrow_stages
VERIFY_NARROW_MIN_ROWS = 33  # from here; 17-32 rows keep the config measured at M = 32
# The decode grid at 65-128 rows (VERIFY_TALL_MIN_ROWS: a verify of 17-32 slots at K=3; the default
# dispatch since session 21, DECODE_MAX_ROWS) keeps the 33-64-row tiles with this pipeline depth. Why
# look: the FP8 launches of a 128-row step took 31.5 ms on the GEMM against 13.4 at 64 rows on the
# decode grid (session 20), 2.35x for twice the rows; one decode program per 64 weight rows converts
# each weight chunk to f16 once for all 128 rows, where the GEMM's 64 x 128 tiles convert it once per
# 64 rows. The depth: a stage holds the [64, 128] FP8 weight chunk and the [128, 128] f16 x slice,
# 40 KB; 2 stages leave room for 2 programs per SM, 3 for one. One program per SM with a deeper
# pipeline won: on the H200 (session 22, `pallas_kernels.bench --parts=fp8_launches
# --fp8_launch_ms=96,128`, one lease) the launches of a step by kernel time took 23.5 / 22.3 ms at
# 96 / 128 rows with 2 stages against 20.1 / 19.4 with 3 (every launch 8-17% faster); batch 32, K=3
# (128-row verifies): natural 3070 -> 3281 tok/s, profiled 2345 -> 2510, plain 1922 / 1947, tokens
# equal plain. 4 stages (160 KB) were slower again: 23.1 against 19.3 ms at 128 rows (gate + up 134 ->
# 170 us, in_proj 61 -> 81). 128-row programs (8 warps) on 128-row tiles took 28.6 ms at 128 rows
# (session 21, 2 stages), slower than 64-row ones here.
VERIFY_TALL_STAGES = 3  # ops setting fp8_verify_tall_stages
VERIFY_TALL_MIN_ROWS = 65
# A narrow launch's output rows per program on the decode grid at 33-128 rows (ops setting
# fp8_verify_narrow_block_o: 64, or 128 with 8 warps; on 64-row tiles two tiles joined per chunk). Until
# session 21 it set the wide launches' rows too (VERIFY_WIDE_BLOCK_O now). Why 128 was tried: at 64
# rows each program reads a [64, 128] f16 x slice from L2 per chunk, twice its weight chunk's bytes;
# 128-row programs halve that traffic. Measured slower on the H200 (session 20, `start_stages64`, the
# launches by kernel time on the tiled weights): o_proj 19.7 -> 44.5 us and mlp_down 48.7 -> 89.3 at 64
# rows, the step's launches 16.7 -> 21.0 ms; on the checkpoint layout (the 64-row sweep of the same
# lease) 128-row programs came within 5% of 64-row ones (o_proj 28.1 against 25.1 us, mlp_down 53.6
# against 56.2 at split 16), so the joined tiles' [2, 64, 128] load is what costs. On 128-row tiles
# without the join (session 21, `start_tiles128`, kernel time per call at 40 / 64 rows): o_proj 18.7 /
# 20.0 -> 22.1 / 22.8 us, out_proj 18.8 / 19.6 -> 22.1 / 23.0, mlp_down 40.7 / 49.1 -> 43.7 / 45.8,
# still slower but for mlp_down at 64 rows. Kept at 64.
VERIFY_NARROW_BLOCK_O = 64
# A wide launch's output rows per program on the decode grid at 33-64 rows, where its weights lie in
# tiles of a multiple of this many rows (fp8_layout's TILE_ROWS, setting fp8_tile_rows; on other
# layouts 64; ops setting fp8_verify_wide_block_o: 64 or 128, 8 warps at 128). Why: at 64 rows each
# program reads a [64, 128] f16 x slice per weight chunk, twice the chunk's bytes, and 128-row programs
# read half as many; the wide launches have programs to spare (gate + up: 272 row blocks of 64).
# Measured on the H200 (session 21, `scripts/gpu_session.sh start_tiles128`, the launches by kernel time
# on 128-row tiles, 128-row programs at 33-64 rows for every launch against 64-row ones): gate + up
# 83.0 / 95.2 -> 79.0 / 82.7 us at 40 / 64 rows, q + k + v 40.1 / 41.6 -> 36.6 / 37.6, in_proj 40.6 /
# 47.7 -> 37.4 / 38.7; the narrow launches slower (VERIFY_NARROW_BLOCK_O). The step's launches 11.70 /
# 13.49 -> 11.65 / 12.15 ms with every launch on 128-row programs; batch 16, K=3 (64-row verifies)
# natural 2557 -> 2729 tok/s (session 20's run against session 21's, one process each).
VERIFY_WIDE_BLOCK_O = 128
# A narrow launch's output rows per program at 1-16 rows (o_proj / out_proj, mlp_down in the 27B step;
# ops setting fp8_narrow_block_o: 64, or 128). Why 128 is worth timing again: at 16 rows the x slices
# the programs read from L2 are half the weight's bytes (o_proj: 15.7 MB per call for 31.5 MB), the
# likely cause of its 11.10 us at 16 rows against 10.49 at 1 (75.7% of copy, the one launch below
# the 80%); 128-row programs halve them. Session 15 measured 128-row programs without gain on
# the checkpoint layout (128 strided runs of 128 bytes per chunk); on 128-row tiles (fp8_layout's
# TILE_ROWS, setting fp8_tile_rows=128) a chunk is one contiguous 16 KB run. Unmeasured (session 20).
NARROW_BLOCK_O = 64
# The GEMM's output tile rows and pipeline depth at 33-256 rows (65-256 with the default dispatch;
# settings fp8_gemm_mid_block_m / fp8_gemm_mid_stages). Why 32 x 128 with 4 stages was tried: the
# 64-row sweep of one [17408, 5120] weight with the f16 piece (session 19) took 63.5 us on them against
# 73.4 for 64 x 128 with 3. Measured slower per launch on the H200 (session 20, `start_stages64`, the
# launches by kernel time, every weight of a launch timed): gate + up 135 -> 218 us at 64 rows and
# 247 -> 363 at 128, q + k + v 55 -> 96, the step's launches at 128 rows 31.6 -> 56.6 ms. Kept at 64 / 3.
GEMM_MID_BLOCK_M = 64
GEMM_MID_STAGES = 3
# True: the GEMM takes bf16 x as one scaled f16 piece per row (PrefillConfig.x_f16_scaled), so its weight
# chunks convert E4M3 -> f16 instead of -> bf16, as the decode kernel has since session 9. Why: at a
# batched verify's rows the GEMM is compute-bound where its launches are wide (gate + up 84 us at 64
# rows, 55% of copy, session 18): its weights are converted once per 64-row block, ~3 instructions per
# weight to bf16 against one per two to f16 (scripts/triton_loop_stats.py: 584 -> 328 PTX instructions
# per chunk at 64 rows). Measured on the H200 (session 19, `scripts/gpu_session.sh start_midrows`), the
# FP8 launches of a 27B step by kernel time, off -> on (each GEMM launch of several weights counted by
# its first weight alone, a bench fault fixed since): 13.12 -> 11.60 ms at 40 rows, 13.80 -> 12.11 at
# 48, 14.19 -> 12.61 at 64, 27.48 -> 21.64 at 128, 90.31 -> 68.19 at 512; end to end at batch 16, K=3
# (64-row verifies): K=3 natural 2105 -> 2297 tok/s, plain unchanged (1311 / 1309: its 16 rows never
# reach the GEMM), tokens equal plain. The piece is exact (a power-of-two scale per row, bf16's 8-bit
# significand inside f16's 11); only the order of the f32 sums inside the dot differs from the bf16 dot.
GEMM_X_F16_SCALED = True


def is_wide(o: int) -> bool:
    """A launch of O output rows is wide when its 64-row blocks alone fill the SMs (gate + up, q + k + v,
    in_proj in the 27B step); narrow ones (o_proj / out_proj, mlp_down) need split-K or other tiles."""
    return cdiv(o, DecodeConfig.block_o) >= SM_COUNT


def decode_config(m: int, o: int, i: int, x_f16_scaled: bool | None = None,
                  tile_rows: int | None = None) -> DecodeConfig:
    """Heuristic from the H200 sweeps (`python -m pallas_kernels.bench --parts=fp8 --fp8_sweep`,
    WORKSPACE.md). With M1_CUDA_CORE, one row of a wide weight (O >= 64 * SM_COUNT): the CUDA-core path with 16-row
    programs, 2 warps, 4 chunks per iteration (2.0-2.5 TB/s vs 1.5-2.1 for the 64-row default).
    Otherwise 64-row programs, split_k (a power of two <= 8, >= 4 chunks per split) until the grid
    has >= 2 programs per SM, so narrow O (o_proj / down_proj: 80 row blocks) fills the H200; more
    rows use the tensor-core dot with at least 2 splits, and the wide shapes put x on the dot's M
    side (measured 1.5 -> 2.0 TB/s at M = 4..16 on [17408, 5120]). x_f16 up to X_F16_MAX_ROWS rows; with
    it at M <= 8 and NARROW_X_ON_M the narrow shapes also put x on the M side, with >= 4 programs per SM.
    17-32 rows (batched verify): split-K 4 with W on the dot's M side, the best of the M = 32 sweep on
    all five shapes (scales loaded per chunk, as measured); 33-64 rows (a batched verify of 9-16
    slots) the same with 3 stages and split-K 8 where runs keep >= 16 chunks (VERIFY_NARROW_STAGES,
    the best of the M = 64 sweep); 65-128 rows (fp8_decode_max_rows raised) the same tiles with
    VERIFY_TALL_STAGES. With X_F16_SCALED (or x_f16_scaled=True, which overrides it) 9-128
    rows take x as one scaled f16 piece per row, and 9-16 rows fit the narrow x-on-M policy. Rows
    per program: NARROW_BLOCK_O for the narrow weights at 1-16 rows, VERIFY_NARROW_BLOCK_O for them
    from 33 rows (both 64 by default; 128 where set, on 128-row tiles without a join),
    VERIFY_WIDE_BLOCK_O for the wide ones at 33-64 rows where tile_rows (the rows of the weights'
    tiles; None: the checkpoint layout) is a multiple of it, 64 otherwise."""
    wide = is_wide(o)
    bo = NARROW_BLOCK_O if not wide and m <= DOT_MIN else 64
    n_o, n_chunks = cdiv(o, bo), cdiv(i, BLOCK)
    chunk = X_CHUNK_SCALED  # one piece per row made in the kernel: M dot rows, as the scaled piece
    scaled = X_F16_SCALED if x_f16_scaled is None else x_f16_scaled
    scaled = X_F16 and scaled and m >= X_F16_SCALED_MIN_ROWS and not chunk
    if m > DOT_MIN:  # a batched verify: the config measured best at M = 32 on every 27B shape, and at
        # 33-64 rows the M = 64 sweep's depth, split and tile (VERIFY_NARROW_*), at 65-128 VERIFY_TALL_STAGES
        mid, tall = m >= VERIFY_NARROW_MIN_ROWS, m >= VERIFY_TALL_MIN_ROWS
        if not mid:  # 17-32 rows: the M = 32 tiles
            block_o = bo
        elif not wide:
            block_o = VERIFY_NARROW_BLOCK_O
        elif tall:  # 128-row programs measured slower at 65-128 rows (VERIFY_TALL_STAGES)
            block_o = 64
        else:  # whole tiles only: joining 64-row tiles was 2.2x slower (VERIFY_NARROW_BLOCK_O)
            block_o = VERIFY_WIDE_BLOCK_O if tile_rows and tile_rows % VERIFY_WIDE_BLOCK_O == 0 else 64
        split = 8 if mid and n_chunks >= 8 * 16 else max(1, min(4, n_chunks // 4))
        stages = VERIFY_TALL_STAGES if tall else VERIFY_NARROW_STAGES if mid else None
        return DecodeConfig(block_o=block_o, split_k=split, use_dot=True, swap_ab=True, x_f16=scaled,
                            x_f16_scaled=scaled, x_chunk_scaled=chunk, num_warps=8 if block_o > 64 else 4,
                            num_stages=stages or DecodeConfig.num_stages)
    if m == 1 and wide and M1_CUDA_CORE:
        return DecodeConfig(block_o=16, split_k=1, use_dot=False, num_warps=2, num_stages=3, chunks_per_step=4,
                            scale_preload=SCALE_PRELOAD)
    dot = m > 1 or not M1_CUDA_CORE
    chunk = chunk and dot
    x_f16 = X_F16 and dot and m <= X_F16_MAX_ROWS and not chunk
    # the narrow x-on-M policy was measured where the piece rows fit the dot's 16-row minimum (M <= 8,
    # or 16 with one scaled piece per row); at 9-16 rows in two pieces the narrow weights keep W on the
    # dot's M side (the M = 16 measurement's tiles)
    narrow_x_on_m = (x_f16 or chunk) and NARROW_X_ON_M and (m if scaled or chunk else 2 * m) <= DOT_MIN
    x_on_m = dot and (wide or narrow_x_on_m)
    narrow = narrow_x_on_m and not wide  # the narrow policy: more programs per SM, NARROW_NUM_STAGES
    per_sm = NARROW_PROGRAMS_PER_SM if narrow else DECODE_PROGRAMS_PER_SM
    split = 1
    while n_o * split < per_sm * SM_COUNT and split < 8 and n_chunks >= 2 * split * 4:
        split *= 2
    if dot and n_chunks >= 16:
        split = max(split, 2)
    return DecodeConfig(block_o=bo, split_k=split, use_dot=dot, swap_ab=not x_on_m, scale_preload=SCALE_PRELOAD,
                        x_f16=x_f16, x_f16_scaled=x_f16 and scaled, x_chunk_scaled=chunk,
                        num_stages=NARROW_NUM_STAGES if narrow else DecodeConfig.num_stages)


def act_quant_config(m: int, o: int, i: int) -> DecodeConfig:
    """The decode config of E4M3 activations (fp8_matmul's act_quant): decode_config's tiles with W on
    the dot's M side (Triton's FP8 wgmma needs 64 rows per warpgroup there; x's <= 32 rows on that
    side fall back to converting both operands to f16 for mma.sync: scripts/triton_loop_stats.py,
    245 instructions per chunk against 123) and x taken as it is (no f16 pieces, scaled or not); the
    pipeline depth its tiles were measured with (NARROW_NUM_STAGES was measured on the f16 path only)."""
    return dataclasses.replace(decode_config(m, o, i), swap_ab=True, x_f16=False, x_f16_scaled=False,
                               x_chunk_scaled=False,
                               num_stages=DecodeConfig.num_stages)


def prefill_config(m: int, o: int, i: int) -> PrefillConfig:
    """Heuristic: GEMM_MID_BLOCK_M x 128 tiles (4 warps, GEMM_MID_STAGES) at 33-256 rows (65-256 with
    the default dispatch), 32 x 128 at fewer, 128 x 128 (8 warps) above; split_k (a power of two, runs
    of >= 4 chunks) while the grid has fewer than GEMM_SPLIT_PROGRAMS programs (0: never);
    x_f16_scaled from GEMM_X_F16_SCALED."""
    if m <= 32:
        config = PrefillConfig(block_m=32, block_n=128, num_warps=4, num_stages=3)
    elif m <= 256:
        config = PrefillConfig(block_m=GEMM_MID_BLOCK_M, block_n=128, num_warps=4, num_stages=GEMM_MID_STAGES)
    else:
        config = PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    tiles, n_chunks = cdiv(m, config.block_m) * cdiv(o, config.block_n), cdiv(i, BLOCK)
    split = 1
    while tiles * split < GEMM_SPLIT_PROGRAMS and n_chunks >= 8 * split:  # doubled, each run keeps >= 4 chunks
        split *= 2
    return dataclasses.replace(config, split_k=split, x_f16_scaled=GEMM_X_F16_SCALED)


def default_config(m: int, o: int, i: int, tile_rows: int | None = None) -> DecodeConfig | PrefillConfig:
    """The dispatch on M: up to DECODE_MAX_ROWS rows stream W on the decode grid, more run the GEMM;
    where DECODE_MAX_ROWS is set lower, a narrow launch (not is_wide) stays on the decode grid up to
    NARROW_DECODE_MAX_ROWS rows. tile_rows: as decode_config's."""
    if m <= DECODE_MAX_ROWS or (not is_wide(o) and m <= min(NARROW_DECODE_MAX_ROWS, DECODE_DOT_MAX_ROWS)):
        return decode_config(m, o, i, tile_rows=tile_rows)
    return prefill_config(m, o, i)
