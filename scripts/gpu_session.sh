#!/usr/bin/env bash
# The measurements that need the GPUs, as background jobs on an nvidia-h200-x2 machine, so that one
# held machine does all of them and each device call only waits and collects:
#
#   scripts/gpu_session.sh start [SECONDS]  copy the tree to /tmp, start the jobs (setsid), wait
#   scripts/gpu_session.sh wait  [SECONDS]  wait until all jobs ended or SECONDS passed
#   scripts/gpu_session.sh start_pieces [SECONDS]  a ~9-minute lease: TP1 plain + K=3 with the defaults and
#                                           under each of PIECES_E2E, the verify pass against a target step
#                                           launch kind by kind (scripts/round_pieces.py) under ROUND_VARIANTS,
#                                           the conv kernel's GPU tests (pieces())
#   scripts/gpu_session.sh start_table [SECONDS]  the full table at the presets: TP1 (~11 minutes), then
#                                           TP2 where the machine has two GPUs (~12 more); beside TP1 on
#                                           GPU 1 the compilation cache, the plain-slots step and the
#                                           server's load test (table(), side_checks())
#   scripts/gpu_session.sh start_rows [SECONDS]  the scaled f16 piece at 9-32 rows: per FP8 weight and
#                                           end to end at batch 4, K=3 (rows())
#   scripts/gpu_session.sh start_floor [SECONDS]  the FP8 launches with their read floors, batch 8 K=3
#                                           with and without the scaled piece, o_proj's tile sweep (floor())
#   scripts/gpu_session.sh start_stages [SECONDS]  the narrow launches' pipeline depth: launches at 4/3/2
#                                           stages, the step at 4 and 3 (stages())
#   scripts/gpu_session.sh start_tiles [SECONDS]  the FP8 launches on the tiled weight layout against the
#                                           checkpoint's, with read floors over both; the tiled `gpu` tests (tiles())
#   scripts/gpu_session.sh start_tiled [SECONDS]  the tiled weights at load (ops.FP8_TILED_WEIGHTS): the
#                                           step, the prefill GEMM and TP1 plain + K=3 with and without, the tiled `gpu` tests (tiled())
#   scripts/gpu_session.sh start_xchunk [SECONDS]  the scaled f16 piece made in the kernel (X_CHUNK_SCALED):
#                                           the FP8 launches and TP1 plain + K=3 with it (xchunk())
#   scripts/gpu_session.sh start_switches [SECONDS]  tiled() then xchunk() (~16 minutes: follow with `wait`)
#   scripts/gpu_session.sh start_midrows [SECONDS]  a batched verify's 33-512 rows: the narrow launches on
#                                           the decode grid against the split GEMM, the GEMM's f16 piece, per
#                                           launch and at batch 12 / 16 K=3 (midrows(); ~25 minutes: follow with `wait`)
#   scripts/gpu_session.sh start_narrow [SECONDS]  the narrow launches' tile sweep at 64 rows with the
#                                           scaled f16 piece: decode grid and split GEMM (narrow())
#   scripts/gpu_session.sh start_stages64 [SECONDS]  (~22 minutes: follow with `wait`, twice) session 19's
#                                           33-256-row configs and the GEMM groups re-timed: `gpu` tests, the
#                                           launches under each choice, batch 16 two ways, batch 1 (stages64())
#   scripts/gpu_session.sh start_batch32 [SECONDS]  (~8 minutes) the tiled `gpu` tests on session 20's
#                                           dispatch, batch 32 plain / K=1 / K=3 (batch32())
#   scripts/gpu_session.sh start_tall [SECONDS]  (~15 minutes: follow with `wait`) the decode grid at
#                                           65-128 rows against the GEMM: `gpu` test, launches, batch 32 (tall())
#   scripts/gpu_session.sh start_tiles128 [SECONDS]  (~15 minutes: follow with `wait`) 128-row weight
#                                           tiles and 128-row programs: `gpu` test, launches, batch 16 (tiles128())
#   scripts/gpu_session.sh start_tall2 [SECONDS]  (~9 minutes) the decode grid at 65-128 rows: launches,
#                                           batch 32 K=3 (tall2())
#   scripts/gpu_session.sh start_defaults21 [SECONDS]  (~24 minutes: follow with `wait` twice) session 21's
#                                           defaults end to end at batch 1 / 16 / 32, o_proj at split-K 4 (defaults21())
#   scripts/gpu_session.sh start_gpuall [SECONDS]  (~8 minutes) every `gpu` test of tests/, one job per
#                                           file, the FP8 kernel's last (gpuall())
#   scripts/gpu_session.sh start_confirm [SECONDS]  a ~10-minute lease: the 64-layer step against the
#                                           variant the last change replaced (pallas_gdnxla), TP1 plain +
#                                           K=3 with a trace of each mode, TP2 plain + K=3 (confirm())
#
# Both end by packing what exists so far into $OUT: results.tgz (logs and JSON) and the trained demo
# checkpoints in pieces under the transfer limit (demo_train.tar.*, demo_train_d3.tar.*; join with
# cat). The machine goes back 30 s after a call ends: issue the next `wait` call at once. Never `pkill -f` a pattern that the calling
# command line itself contains (it kills that command; one session lost its jobs so).
# The server needs wheels the GPU image lacks, carried in .whl (device tool: carry [".whl"]):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl fastapi uvicorn starlette pydantic pydantic_core \
#     annotated-types typing-inspection annotated-doc sniffio opentelemetry-api
# (the versions of .venv; anyio, h11, click, typing_extensions and idna are in the image). Jobs:
#   GPU 0: the Qwen3.5-27B-shaped controlled FP8 checkpoint, then the verify pass against a target step
#          launch kind by kind (scripts/round_pieces.py),
#          TP1 plain + K=3 with the defaults and the round breakdown, then with E4M3 activations if the
#          step measured them faster; with SERVE=1 also the server load test on that checkpoint
#          (issue 7), MTP K=3 then plain
#   GPU 1: the 64-layer step with E4M3 activations and with the GDN conv tiles BV = 16 and 8, every FP8
#          shape at 1/4/16 rows with and without E4M3 activations, the conv kernel's tile sweep, then
#          TP1 plain + K=3 with the best conv tile if it beat the default by 1%, then (TRAIN=1) the two
#          demo recipes and their benches (issue 8). About 12 minutes per line.
#   both:  once both lines ended, with SHORT_TP2=1 TP2 plain + K=3 with and without XLA's one-shot
#          all-reduce kernel (short runs); the full TP2 table (FULL_TP2=1, the default; with GPU 1's
#          winning XLA settings, and E4M3 activations if TP1 measured them faster end to end),
#          ~10 minutes (~5 with TABLE_ARGS="--ks=3 --repeats=2")
#   TABLE_ARGS (environment) is appended to the TP2 table's flags: TABLE_ARGS="--ks=3 --repeats=2" makes
#          it plain + K=3 only, for a lease that keeps time for a second one
set -u
R=/tmp/qmtp_run
SRC=/tmp/qmtp_src
cmd=${1:-wait}
limit=${2:-560}

pack() {  # only logs, JSON, plots and metrics: a file back from $OUT may hold 16 MiB at most
  [ -n "${OUT:-}" ] || return 0
  (cd $R && tar czf "$OUT/results.tgz" $(ls *.log *.json *.png *.txt *.csv *.out hlo/*.gz 2>/dev/null) \
     $(ls train*/*.json train*/*.png train*/*.jsonl train*/best/best.json 2>/dev/null))
  for run in train train_d3; do
    if [ -f $R/$run/export/config.json ]; then
      (cd $R/$run && tar cf - export | split -b 15000000 - "$OUT/demo_${run}.tar.")
    fi
  done
  ls -la "$OUT"
  for f in $R/*.log; do echo "== $f"; tail -n 3 "$f" | cut -c1-250; done
}

wait_and_pack() {  # until every job ended or $limit seconds passed; then the log and pack
  local t0=$(date +%s)
  while [ ! -f $R/all.done ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
    sleep 5
    # re-pack after each job's end, so that a call cut short by the device budget still returns it
    if [ -n "${OUT:-}" ] && [ $R/jobs.log -nt "$OUT/results.tgz" ]; then pack >/dev/null 2>&1; fi
  done
  cat $R/jobs.log
  pack
}

job() {  # name timeout_s command... (one line of the log per job start/end in $R/jobs.log)
  local name=$1 t=$2
  shift 2
  echo "$(date +%T) start $name" >>$R/jobs.log
  timeout "$t" "$@" >$R/$name.log 2>&1
  local rc=$?
  echo "rc=$rc" >>$R/$name.log
  echo "$(date +%T) end $name rc=$rc" >>$R/jobs.log
}

gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  job checkpoint27 300 python3 -c "
import time; from qmtp.tools import make_checkpoint as m
t = time.time(); p = m.ensure_preset('qwen3_5_27b_controlled', 'fp8'); print(p, 'written in', round(time.time() - t, 1), 's')"
  touch $R/checkpoint27.done
  # issue 6: the verify pass against a target step, launch kind by kind (scripts/round_pieces.py)
  job round_pieces 300 python3 scripts/round_pieces.py --k=3 --pieces=target_step,verify,draft \
    --out=$R/round_pieces.json
  # end to end with the defaults, with the round breakdown and its launch kinds
  job tp1_k3_default 480 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=2 \
    --out=$R/tp1_k3_default.json
  # E4M3 activations (ops.FP8_ACT_QUANT, off by default): plain + K=3 end to end, if the step bench
  # on GPU 1 measured it faster (its tokens differ from the exact path's; MTP must still equal plain)
  while [ ! -f $R/step_variants.done ]; do sleep 5; done
  if grep -q pallas_a8 $R/step_faster.txt 2>/dev/null; then
    job tp1_k3_a8 420 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=2 \
      --breakdown=false --kernels=fp8_act_quant=true --out=$R/tp1_k3_a8.json
  fi
  if [ "${SERVE:-0}" = 1 ]; then serve 3 8003 full; serve 0 8000 short; fi
  touch $R/gpu0.done
}

checkpoint27() {  # the Qwen3.5-27B-shaped controlled FP8 checkpoint (reused where it exists), as a job
  job checkpoint27 300 python3 -c "
from qmtp.tools import make_checkpoint as m; print(m.ensure_preset('qwen3_5_27b_controlled', 'fp8'))"
}

tp1_over() {  # side_checks on GPU 1 of a two-GPU machine once the TP1 table has ended: start nothing more
  [ -f $R/tp1.done ] && [ "${CUDA_VISIBLE_DEVICES:-}" = 1 ]
}

serve() {  # K PORT full|short
  local k=$1 port=$2 how=$3
  python3 -m qmtp.server --checkpoint=${SERVE_CKPT:-preset:qwen3_5_27b_controlled:fp8} --served_model_name=q27 \
    --dtype=${SERVE_DTYPE:-bfloat16} --impl=${SERVE_IMPL:-pallas} --mtp_k=$k --batch_slots=8 --rounds_per_call=8 --max_model_len=512 --max_tokens_limit=256 \
    --port=$port --warmup_prompt_lengths=64 --log_level=warning >$R/server_k$k.log 2>&1 &
  local pid=$! t0=$(date +%s)
  # wait for /health; give up at once if the server process has died (e.g. a missing package)
  timeout 300 python3 -c "
import os, sys, time, httpx
while True:
    try:
        os.kill($pid, 0)
    except OSError:
        sys.exit(1)
    try:
        if httpx.get('http://127.0.0.1:$port/health', timeout=1).status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(1)" || { echo "server K=$k did not come up" >>$R/server_k$k.log; kill $pid 2>/dev/null; return; }
  echo "server K=$k up after $(( $(date +%s) - t0 )) s (load + compile)" >>$R/jobs.log
  job load_k${k} 150 python3 scripts/load_test.py --url=http://127.0.0.1:$port --requests=128 --concurrency=8 \
    --prompt_tokens=33,64 --max_tokens=64 --output_json=$R/load_k$k.json
  if [ "$how" = full ]; then
  job load_k${k}_stream 120 python3 scripts/load_test.py --url=http://127.0.0.1:$port --requests=64 --concurrency=8 \
    --prompt_tokens=33,64 --max_tokens=64 --stream --seed=1 --output_json=$R/load_k${k}_stream.json
  job load_k${k}_c1 90 python3 scripts/load_test.py --url=http://127.0.0.1:$port --requests=16 --concurrency=1 \
    --prompt_tokens=64,64 --max_tokens=64 --seed=2 --output_json=$R/load_k${k}_c1.json
  fi
  python3 -c "import httpx; print(httpx.get('http://127.0.0.1:$port/metrics').text)" >$R/metrics_k$k.txt 2>&1
  kill -TERM $pid; wait $pid; echo "server K=$k exit status $?" >>$R/jobs.log
}

gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  # issue 4: the 64-layer step with E4M3 activations (pallas_a8) and the GDN conv kernel's tile at
  # BV = 16 and 8; step_faster.txt lists the variants > 1% faster than the defaults
  job step_variants 300 python3 -m pallas_kernels.bench --parts=step \
    --step_impls=pallas,pallas_a8,pallas_gdnbv16,pallas_gdnbv8,pallas_gdnbv8w1 --out=$R/step_variants.json \
    --step_hlo_dir=$R/hlo  # each variant's compiled step: what the activation quantization fuses into
  python3 -c "
import json
r = {x['impl']: x['s_per_call'] for x in json.load(open('$R/step_variants.json'))['rows'] if x.get('kernel') == 'decode_step'}
print(' '.join(k for k, v in r.items() if k != 'pallas' and 'pallas' in r and v < 0.99 * r['pallas']))" \
    >$R/step_faster.txt 2>>$R/trace.log
  echo "step variants > 1% faster: '$(cat $R/step_faster.txt)'" >>$R/jobs.log
  touch $R/step_variants.done
  # every FP8 shape at 1/4/16 rows: the default, the default on E4M3 activations (pallas_a8), device
  # time; when the step measured E4M3 activations faster, also their tile sweep (--fp8_a8_sweep)
  job bench_fp8_a8 420 python3 -m pallas_kernels.bench --parts=fp8 --fp8_ms=1,4,16 --fp8_prefill_ms= --xla=false \
    $(grep -q pallas_a8 $R/step_faster.txt && echo --fp8_a8_sweep) --out=$R/bench_fp8_a8.json
  # the conv kernel alone over six tiles at B = 1 and 8, T = 1, 4, 5 (kernel gdn_conv_decode)
  job bench_gdn_conv 300 python3 -m pallas_kernels.bench --parts=gdn --gdn_cases=conv --gdn_batches=1,8 \
    --out=$R/bench_gdn_conv.json
  : >$R/xla_flags_best.txt  # no XLA-settings sweep this lease (session 9's: no end-to-end winner)
  while [ ! -f $R/checkpoint27.done ]; do sleep 5; done
  # end to end with the best conv tile of the step, if one beat the default
  local bv=$(python3 -c "
import json
r = {x['impl']: x['s_per_call'] for x in json.load(open('$R/step_variants.json'))['rows'] if x.get('kernel') == 'decode_step'}
tiles = {'pallas_gdnbv16': 'gdn_conv_block_v=16', 'pallas_gdnbv8': 'gdn_conv_block_v=8',
         'pallas_gdnbv8w1': 'gdn_conv_block_v=8,gdn_conv_num_warps=1'}
r = {k: v for k, v in r.items() if k == 'pallas' or k in tiles}
best = min(r, key=r.get) if r else 'pallas'
print(tiles[best] if best != 'pallas' and r[best] < 0.99 * r['pallas'] else '')" 2>>$R/trace.log)
  echo "best GDN conv tile: '$bv'" >>$R/jobs.log
  if [ -n "$bv" ]; then
    job tp1_k3_gdnbv 480 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=2 \
      --breakdown=false --kernels=$bv --out=$R/tp1_k3_gdnbv.json
  fi
  if [ "${TRAIN:-0}" = 1 ]; then
    job train_demo 420 python3 -m qmtp.train --flagfile=configs/train_demo.flags --out_dir=$R/train
    job train_demo_d3 480 python3 -m qmtp.train --flagfile=configs/train_demo.flags --out_dir=$R/train_d3 \
      --mtp_depth=3 --mtp_loss_weight=0.5
    for run in train train_d3; do
      [ -f $R/$run/export/config.json ] || continue
      job demo_bench_$run 150 python3 -m qmtp.bench --flagfile=configs/bench_demo.flags --checkpoint=$R/$run/export \
        --engine=pallas --dtype=bfloat16 --out=$R/demo_bench_$run.json
    done
  fi
  touch $R/gpu1.done
}

both() {
  while [ ! -f $R/gpu0.done ] || [ ! -f $R/gpu1.done ]; do sleep 5; done
  unset CUDA_VISIBLE_DEVICES
  # 131 small all-reduces per step; XLA's own one-shot kernel for small all-reduces vs NCCL
  local oneshot=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true
  # session 5: the one-shot kernel changed nothing (95.4 vs 95.5 tok/s plain); compared only when asked
  for mode in $([ "${SHORT_TP2:-0}" = 1 ] && echo nccl oneshot); do
    XLA_FLAGS="$([ $mode = oneshot ] && echo $oneshot)" job tp2_$mode 420 python3 -m qmtp.bench \
      --flagfile=configs/bench_27b_fp8_tp2.flags --ks=3 --repeats=2 --out=$R/tp2_$mode.json --converted_cache=/tmp/qmtp_conv
  done
  local best=$(python3 -c "
import json
def plain(m):
    try: return json.load(open('$R/tp2_%s.json' % m))['cases'][0]['modes'][0]['decode_tokens_per_s']['median']
    except Exception: return 0.0
print('$oneshot' if plain('oneshot') > plain('nccl') else '')")
  best="$best $(cat $R/xla_flags_best.txt 2>/dev/null)"  # and GPU 1's winning XLA settings, if any
  # and E4M3 activations if TP1 measured them faster end to end (plain and K=3 profiled both > 1%)
  local kernels=$(python3 -c "
import json
def rates(name):
    try:
        return {m['name']: m['decode_tokens_per_s']['median'] for m in json.load(open('$R/%s.json' % name))['cases'][0]['modes']}
    except Exception:
        return {}
a8, base = rates('tp1_k3_a8'), rates('tp1_k3_default')
keys = ('plain', 'mtp K=3 profiled')
print('--kernels=fp8_act_quant=true' if a8 and base and all(a8.get(k, 0) > 1.01 * base.get(k, 1e9) for k in keys) else '')" \
    2>>$R/trace.log)
  if [ "${FULL_TP2:-1}" = 1 ]; then
    echo "full TP2 table with XLA_FLAGS='$best' $kernels" >>$R/jobs.log
    XLA_FLAGS="$best" job bench27_tp2 600 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp2.flags \
      --out=$R/bench27_tp2.json --converted_cache=/tmp/qmtp_conv ${TABLE_ARGS:-} $kernels
  fi
  # (NCCL_PROTO=LL end to end was measured in session 7: 112.9 vs 111.8 tok/s, no gain; not re-run)
  # (session 8's all-reduce probe: NCCL symmetric buffers 10% faster per all-reduce, no gain end to
  # end; NVSHMEM not in this jaxlib: scripts/allreduce_probe.py, not re-run)
  touch $R/all.done
}

confirm() {  # a short lease: the step against the variant the last change replaced, TP1 plain + K=3
  # with a profiler trace of each mode (summarized here: the traces stay on the machine), TP2 plain + K=3
  (export CUDA_VISIBLE_DEVICES=1
   job bench_step 200 python3 -m pallas_kernels.bench --parts=step --step_impls=pallas,pallas_gdnxla \
     --out=$R/bench_step.json) &
  checkpoint27
  CUDA_VISIBLE_DEVICES=0 job tp1_short 330 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 \
    --repeats=2 --breakdown=false --out=$R/tp1_short.json --trace_dir=/tmp/qmtp_e2e_trace
  for d in /tmp/qmtp_e2e_trace/*/; do
    python3 scripts/trace_summary.py "$d" --json --top=40 >$R/e2e_trace_$(basename "$d").json 2>>$R/trace.log
  done
  wait
  job tp2_short 300 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp2.flags --ks=3 --repeats=2 \
    --breakdown=false --out=$R/tp2_short.json
}

pieces() {  # a ~9-minute lease. GPU 0: the 27B checkpoint, then TP1 plain + K=3 end to end with the
  # defaults and with each of PIECES_E2E (kernel settings, ";"-separated; default: the slotted GDN state
  # off), all in one lease so the ratios compare. GPU 1: the conv kernel's GPU tests, then (once the
  # checkpoint is written) the verify pass and the commit against a target step, launch kind by kind,
  # with the defaults and under each of ROUND_VARIANTS (scripts/round_pieces.py --variants). On a
  # one-GPU machine GPU 1's jobs run after GPU 0's (~12 minutes).
  export CUDA_VISIBLE_DEVICES=0
  checkpoint27
  touch $R/checkpoint.done
  gpu1_pieces() {
    job gpu_tests_gdn 200 python3 -m pytest -q -m gpu tests/test_kernel_gdn_conv.py -p no:cacheprovider
    while [ ! -f $R/checkpoint.done ]; do sleep 5; done
    job round_pieces 330 python3 scripts/round_pieces.py --k=3 --pieces=target_step,verify,commit \
      --variants="${ROUND_VARIANTS:-gdn_state_slots=false}" --out=$R/round_pieces.json
  }
  local gpus
  gpus=$(nvidia-smi -L | wc -l)
  [ "$gpus" -ge 2 ] && (export CUDA_VISIBLE_DEVICES=1; gpu1_pieces) &
  job tp1_short 330 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 \
    --repeats=2 --breakdown=false --out=$R/tp1_short.json
  local i=0 kernels
  IFS=";" read -ra e2e <<<"${PIECES_E2E-gdn_state_slots=false}"  # PIECES_E2E= : none
  for kernels in "${e2e[@]}"; do
    i=$((i + 1))
    job tp1_short_v$i 330 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 \
      --repeats=2 --breakdown=false --kernels=$kernels --out=$R/tp1_short_v$i.json
  done
  [ "$gpus" -ge 2 ] || gpu1_pieces
  wait
}

table() {  # the issue-6 table at the presets (1024 tokens, K = 1..4 natural and profiled, the round
  # breakdown): TP1 on GPU 0 (~11 minutes: one compile of ~100 s per K), then TP2 over both GPUs where
  # there are two (~12 minutes). Beside TP1 on GPU 1 (or after the tables on a one-GPU machine),
  # side_checks(): the compilation cache, the plain-slots step A/B and the server's load test. TABLE_ARGS
  # is appended to both tables. Needs `wait` calls after the start. Carry .whl for the server.
  export CUDA_VISIBLE_DEVICES=0
  local gpus
  gpus=$(nvidia-smi -L | wc -l)
  checkpoint27
  if [ "$gpus" -ge 2 ]; then
    (export CUDA_VISIBLE_DEVICES=1; side_checks) &
  fi
  job bench27_tp1 1200 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --repeats=2 \
    --out=$R/bench27_tp1.json ${TABLE_ARGS:-}
  touch $R/tp1.done  # side_checks starts no new job after this
  wait  # GPU 1's current job ends before TP2 takes both GPUs
  if [ "$gpus" -ge 2 ]; then
    unset CUDA_VISIBLE_DEVICES
    job bench27_tp2 1200 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp2.flags --repeats=2 \
      --out=$R/bench27_tp2.json --compare_to=$R/bench27_tp1.json ${TABLE_ARGS:-}
  else
    export CUDA_VISIBLE_DEVICES=0
    side_checks
  fi
}

side_checks() {  # one GPU's checks, each skipped once $R/tp1.done exists on a two-GPU machine:
  # 1. the persistent compilation cache (qmtp/compile_cache.py, on by default): the same K=3 generation
  #    twice; the second process should load its prefill and loop (compile/warm-up line, cache_check.txt)
  # 2. the 64-layer step with the plain loops' GDN state in two slots (pallas_plainslots) against the
  #    default, step_plainslots.json
  # 3. with SERVE=1 (the default) the server's load test with MTP K=3, then plain
  local run
  for run in 1 2; do
    tp1_over && return
    JAX_DEBUG_LOG_MODULES=jax._src.compiler job cache_check_$run 400 python3 -m qmtp.generate \
      --checkpoint=preset:qwen3_5_27b_controlled:fp8 --impl=pallas --mtp_k=3 --max_new_tokens=64 --prompt_ids=1,2,3,4
  done
  grep -h "compile/warm-up\|cache hit for\|Error .*persistent" $R/cache_check_*.log | cut -c1-200 >$R/cache_check.txt
  tp1_over && return
  job step_plainslots 300 python3 -m pallas_kernels.bench --parts=step --step_impls=pallas,pallas_plainslots \
    --out=$R/step_plainslots.json
  if [ "${SERVE:-1}" = 1 ]; then
    tp1_over && return
    serve 3 8193 short
    tp1_over && return
    serve 0 8194 short
  fi
}

rows() {  # a ~9-minute lease for the scaled f16 piece (fp8_config.X_F16_SCALED, off until measured):
  # GPU 0: every FP8 shape at 8, 16 and 32 rows, the default beside the scaled form, and the step's FP8
  # launches at 1, 4 and 16 rows against issue 4's 80% (fp8_rows.json), the launches at 16 and 32 rows
  # with the scaled form (fp8_launches_scaled.json), the 64-layer step (step_default.json);
  # GPU 1 (or after, on one GPU): the 27B checkpoint, then batch 4 K=3 end to end (16-row verify
  # passes), the defaults and then with --kernels=fp8_x_f16_scaled=true (bench27_b4*.json)
  local gpus
  gpus=$(nvidia-smi -L | wc -l)
  b4() {
    checkpoint27
    job bench27_b4 420 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --batch=4 --ks=3 \
      --repeats=1 --max_new_tokens=256 --breakdown=false --out=$R/bench27_b4.json
    job bench27_b4_scaled 420 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --batch=4 --ks=3 \
      --repeats=1 --max_new_tokens=256 --breakdown=false --kernels=fp8_x_f16_scaled=true --out=$R/bench27_b4_scaled.json
  }
  if [ "$gpus" -ge 2 ]; then (export CUDA_VISIBLE_DEVICES=1; b4) & fi
  export CUDA_VISIBLE_DEVICES=0
  job fp8_rows 420 python3 -m pallas_kernels.bench --parts=fp8,fp8_launches --fp8_ms=8,16,32 --fp8_prefill_ms= \
    --xla=false --out=$R/fp8_rows.json
  job fp8_launches_scaled 200 python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_ms=16,32 \
    --kernels=fp8_x_f16_scaled=true --out=$R/fp8_launches_scaled.json
  # the step with the nested-jit launches (session 14): unchanged at 9.23 ms and 1062 launches?
  job step_default 300 python3 -m pallas_kernels.bench --parts=step --step_impls=pallas --out=$R/step_default.json
  if [ "$gpus" -lt 2 ]; then b4; fi
  wait
}

floor() {  # a ~14-minute lease on one GPU after the scaled piece became the default (session 15):
  # the step's FP8 launches at 1/4/16 rows with each launch's read floor (launches_floor.json); batch 8
  # K=3 end to end (32-row verifies) with the default and with the scaled piece off (bench27_b8*.json);
  # o_proj / out_proj's tile sweep at 1 and 16 rows (oproj_sweep.json)
  export CUDA_VISIBLE_DEVICES=0
  job launches_floor 300 python3 -m pallas_kernels.bench --parts=fp8_launches --out=$R/launches_floor.json
  checkpoint27
  job bench27_b8 300 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --batch=8 --ks=3 \
    --repeats=1 --max_new_tokens=256 --breakdown=false --out=$R/bench27_b8.json
  job bench27_b8_pieces 300 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --batch=8 --ks=3 \
    --repeats=1 --max_new_tokens=256 --breakdown=false --kernels=fp8_x_f16_scaled=false --out=$R/bench27_b8_pieces.json
  oproj_sweep oproj_sweep
}

stages() {  # a ~4-minute lease on one GPU: the narrow x-on-M launches' pipeline depth
  # (fp8_config.NARROW_NUM_STAGES): the step's FP8 launches at 1/4/16 rows with 4 (the default), 3 and 2
  # stages (launches_s*.json), then the 64-layer step with 4 and 3 (step_s*.json)
  export CUDA_VISIBLE_DEVICES=0
  for st in 4 3 2; do
    job launches_s$st 150 python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_floor=false \
      --kernels=fp8_narrow_num_stages=$st --out=$R/launches_s$st.json
  done
  for st in 4 3; do
    job step_s$st 150 python3 -m pallas_kernels.bench --parts=step --step_impls=pallas \
      --kernels=fp8_narrow_num_stages=$st --out=$R/step_s$st.json
  done
}

oproj_sweep() {  # NAME: o_proj / out_proj's tile sweep at 1 and 16 rows, as a job ($R/NAME.json)
  job $1 300 python3 -m pallas_kernels.bench --parts=fp8 --fp8_ms=1,16 --fp8_shapes=5120x6144 \
    --fp8_prefill_ms= --xla=false --fp8_sweep --fp8_sweep_match=x_f16=True --out=$R/$1.json
}

oproj() {  # a ~3-minute lease on one GPU: o_proj / out_proj's tile sweep around the 3-stage default
  export CUDA_VISIBLE_DEVICES=0
  oproj_sweep oproj_sweep3
}

tiles() {  # a ~8-minute lease on one GPU: the tiled weight layout (fp8_matmul.tile_weight) against the
  # checkpoint's: every FP8 launch of the step at 1/4/16 rows on both, with read floors over both layouts
  # (launches_tiles.json), then the FP8 kernel's `gpu` tests of the tiled layout (gputests_tiles.log)
  export CUDA_VISIBLE_DEVICES=0
  job launches_tiles 420 python3 -m pallas_kernels.bench --parts=fp8_launches \
    --fp8_launch_layouts=checkpoint,tiled --out=$R/launches_tiles.json
  job gputests_tiles 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_fp8_matmul.py -k tiled
}

tiled() {  # a ~9-minute lease on one GPU for ops.FP8_TILED_WEIGHTS (off until this measures it): the
  # FP8 kernel's tiled and in-kernel-piece `gpu` tests (gputests_tiled.log), the 64-layer step with
  # checkpoint-layout and tiled weights, each with and without the in-kernel piece (step_tiled.json), the prefill GEMM per shape at 64 and 512 rows on both layouts
  # (prefill_tiled.json), TP1 plain + K=3 end to end with each (bench27_untiled.json, bench27_tiled.json)
  export CUDA_VISIBLE_DEVICES=0
  job gputests_tiled 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_fp8_matmul.py \
    -k "tiled or chunk"
  job step_tiled 300 python3 -m pallas_kernels.bench --parts=step \
    --step_impls=pallas_untiled,pallas,pallas_untiled_xchunk,pallas_xchunk --out=$R/step_tiled.json
  job prefill_tiled 200 python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_ms=64,512 \
    --fp8_launch_layouts=checkpoint,tiled --fp8_launch_floor=false --out=$R/prefill_tiled.json
  checkpoint27
  job bench27_tiled 240 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=2 \
    --breakdown=false --out=$R/bench27_tiled.json
  job bench27_untiled 200 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=2 \
    --breakdown=false --kernels=fp8_tiled_weights=false --out=$R/bench27_untiled.json
}

xchunk() {  # a ~7-minute lease on one GPU for fp8_config.X_CHUNK_SCALED (the scaled f16 piece made in the
  # kernel, off until this measures it): the step's FP8 launches at 1/4/16 rows without and with it
  # (the kernel's time and every kernel of a call, busy_*: the XLA pieces launch it removes;
  # launches_xchunk_*.json), TP1 plain + K=3 end to end with it (bench27_xchunk.json; the default's
  # figure is start_tiled's bench27_untiled)
  export CUDA_VISIBLE_DEVICES=0
  for on in false true; do
    job launches_xchunk_$on 200 python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_floor=false \
      --kernels=fp8_x_chunk_scaled=$on --out=$R/launches_xchunk_$on.json
  done
  checkpoint27
  job bench27_xchunk 240 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=2 \
    --breakdown=false --kernels=fp8_x_chunk_scaled=true --out=$R/bench27_xchunk.json
}

switches() {  # ~16 minutes over two calls (start_switches, then wait): tiled() then xchunk(), the two
  # switches session 17 left off until measured (the 27B checkpoint is built once)
  tiled
  xchunk
}

midrows() {  # a ~25-minute lease on one GPU (start_midrows, then wait) for a batched verify's 33-512 rows, most needed first (session 18
  # ran a first form; the defaults since then: the GEMM split along I, fp8_config.GEMM_SPLIT_PROGRAMS,
  # and the narrow launches on the decode grid up to 64 rows, NARROW_DECODE_MAX_ROWS; off: the GEMM's
  # scaled f16 piece, GEMM_X_F16_SCALED): the FP8 kernel's `gpu` tests of those rows
  # (gputests_midrows.log); the step's FP8 launches at 40-512 rows with the defaults, with the f16 piece
  # in the GEMM, and at 40-64 with the narrow launches on the GEMM (launches_mid_*.json); end to end
  # plain + K=3 at batch 16 (64-row verifies) with the defaults, with the f16 piece, as before session 18
  # (both switches off); the wide weights' 64-row GEMM tile sweep; batch 12 (48 rows); the 64-layer
  # step under XLA's programmatic dependent launch on and off (the tail may be cut by the budget)
  export CUDA_VISIBLE_DEVICES=0
  job gputests_midrows 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_fp8_matmul.py \
    -k "verify_rows or prefill_default"
  local launches="python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_floor=false"
  job launches_mid_default 150 $launches --fp8_launch_ms=40,48,64,128,512 --out=$R/launches_mid_default.json
  job launches_mid_f16 150 $launches --fp8_launch_ms=40,48,64,128,512 --kernels=fp8_gemm_x_f16_scaled=true \
    --out=$R/launches_mid_f16.json
  job launches_mid_gemm 120 $launches --fp8_launch_ms=40,48,64 --kernels=fp8_narrow_decode_max_rows=0 \
    --out=$R/launches_mid_gemm.json
  checkpoint27
  local bench="python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=1 \
    --max_new_tokens=256 --breakdown=false"
  job bench27_b16 200 $bench --batch=16 --out=$R/bench27_b16.json
  job bench27_b16_f16 200 $bench --batch=16 --kernels=fp8_gemm_x_f16_scaled=true --out=$R/bench27_b16_f16.json
  job bench27_b16_before 200 $bench --batch=16 --kernels=fp8_gemm_split_programs=0,fp8_narrow_decode_max_rows=0 \
    --out=$R/bench27_b16_before.json
  # the wide weights at 64 rows over the GEMM's tiles, with and without the f16 piece (rows as JSON lines
  # in gemm_sweep_m64.log as they come, gemm_sweep_m64.json at the end)
  job gemm_sweep_m64 300 python3 -m pallas_kernels.bench --parts=fp8 --fp8_ms=64 --fp8_prefill_ms= --xla=false \
    --fp8_shapes=17408x5120,12288x5120,10240x5120 --fp8_sweep --fp8_sweep_match=PrefillConfig \
    --out=$R/gemm_sweep_m64.json
  job bench27_b12 200 $bench --batch=12 --out=$R/bench27_b12.json
  for pdl in true false; do
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_pdl=$pdl" job step_pdl_$pdl 120 python3 -m pallas_kernels.bench \
      --parts=step --step_impls=pallas --out=$R/step_pdl_$pdl.json
  done
}

narrow() {  # a ~3-minute lease on one GPU (session 19): the narrow launches (o_proj / out_proj, mlp_down)
  # at a batched verify's 64 rows, where they run at 31-36% of copy on the decode grid: the tile sweep
  # over the scaled-piece configs, decode grid and split GEMM (rows as JSON lines in narrow_sweep_m64.log)
  export CUDA_VISIBLE_DEVICES=0
  job narrow_sweep_m64 240 python3 -m pallas_kernels.bench --parts=fp8 --fp8_ms=64 --fp8_prefill_ms= --xla=false \
    --fp8_shapes=5120x6144,5120x17408 --fp8_sweep --fp8_sweep_match=x_f16_scaled=True --out=$R/narrow_sweep_m64.json
}

stages64() {  # a ~22-minute lease on one GPU (start_stages64, then wait, twice), most needed first: session
  # 19's 33-64-row configs, and the GEMM groups re-timed once fp8_launches read all their weights (until
  # session 19's fix it timed the first weight of a GEMM group alone, so session 18's "wide launches are
  # faster on the GEMM" rests on half their bytes). The `gpu` tests of the tiled defaults at 40 / 64 rows,
  # the verify rows and the joined tiles; the step's FP8 launches at 40 / 48 / 64 / 128 rows with the
  # defaults, with every launch of <= 64 rows on the decode grid (fp8_decode_max_rows=64), at 4 stages,
  # with 128-row narrow programs, with the GEMM's 32 x 128 x 4-stage mid-row tiles; batch 16 plain + K=3
  # with the defaults (session 19 before the 3-stage change: 1309 / 2297 / 1771 tok/s) and with every
  # launch on the decode grid; TP1 batch 1; the narrow 64-row sweep with its 128-row candidates
  export CUDA_VISIBLE_DEVICES=0
  job gputests_stages64 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_fp8_matmul.py \
    -k "tiled_default or verify_rows or joined"
  local launches="python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_floor=false --fp8_launch_ms=40,48,64,128"
  job launches_default 120 $launches --out=$R/launches_default.json
  job launches_decode64 120 $launches --kernels=fp8_decode_max_rows=64 --out=$R/launches_decode64.json
  checkpoint27
  local bench="python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=1 \
    --max_new_tokens=256 --breakdown=false"
  job bench27_b16 260 $bench --batch=16 --out=$R/bench27_b16.json
  job bench27_b16_decode64 260 $bench --batch=16 --kernels=fp8_decode_max_rows=64 --out=$R/bench27_b16_decode64.json
  job launches_stages4 120 $launches --kernels=fp8_verify_narrow_stages=4 --out=$R/launches_stages4.json
  job launches_bo128 120 $launches --kernels=fp8_verify_narrow_block_o=128 --out=$R/launches_bo128.json
  job launches_gemm32 150 $launches --kernels=fp8_gemm_mid_block_m=32,fp8_gemm_mid_stages=4 \
    --out=$R/launches_gemm32.json
  job bench27_b1 300 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=1 \
    --breakdown=false --out=$R/bench27_b1.json
  narrow  # the 64-row sweep of the narrow shapes, now with 128-row programs among its candidates
}

batch32() {  # a ~8-minute lease on one GPU (start_batch32): session 20's dispatch (every launch of <= 64
  # rows on the decode grid) under its tiled `gpu` tests (40 / 64 rows now on the decode grid for the wide
  # weights too), then batch 32, where a K=3 verify is 128 rows (the GEMM) and a K=1 verify 64 (the
  # decode grid): plain, K=1 and K=3 with natural and profiled acceptance
  export CUDA_VISIBLE_DEVICES=0
  job gputests_tiled_default 130 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_fp8_matmul.py \
    -k tiled_default
  checkpoint27
  job bench27_b32 400 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=1,3 --repeats=1 \
    --max_new_tokens=128 --breakdown=false --batch=32 --out=$R/bench27_b32.json
}

tall() {  # a ~15-minute lease on one GPU (start_tall, then wait): session 20's decode grid at 65-128 rows
  # (off by default: fp8_decode_max_rows=128) against the GEMM there. Its `gpu` test; the step's FP8
  # launches at 96 / 128 rows with the default (the GEMM), on the decode grid at 2 and 3 stages; batch 32
  # K=3 (128-row verifies) both ways (session 20 on the GEMM: plain 1952, K=3 profiled 2070 tok/s)
  export CUDA_VISIBLE_DEVICES=0
  job gputests_tall 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_fp8_matmul.py -k tall
  local launches="python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_floor=false --fp8_launch_ms=96,128"
  job launches_tall_gemm 120 $launches --out=$R/launches_tall_gemm.json
  job launches_tall_decode 120 $launches --kernels=fp8_decode_max_rows=128 --out=$R/launches_tall_decode.json
  job launches_tall_decode_s3 120 $launches --kernels=fp8_decode_max_rows=128,fp8_verify_tall_stages=3 \
    --out=$R/launches_tall_decode_s3.json
  # and with 128-row programs on 128-row tiles (x slices read once per 128 weight rows; 8 warps)
  job launches_tall_decode_bo128 120 $launches \
    --kernels=fp8_decode_max_rows=128,fp8_tile_rows=128,fp8_verify_narrow_block_o=128 \
    --out=$R/launches_tall_decode_bo128.json
  checkpoint27
  local bench="python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=1 \
    --max_new_tokens=128 --breakdown=false --batch=32"
  job bench27_b32_gemm 330 $bench --out=$R/bench27_b32_gemm.json
  job bench27_b32_decode 330 $bench --kernels=fp8_decode_max_rows=128 --out=$R/bench27_b32_decode.json
}

tiles128() {  # a ~15-minute lease on one GPU (start_tiles128, then wait): session 20's 128-row weight
  # tiles (fp8_tile_rows=128, off by default) and the 128-row programs they allow without a join. Their
  # `gpu` test; the step's FP8 launches at 1 / 4 / 16 / 40 / 64 rows with the defaults, on 128-row tiles
  # (64-row programs reading halves: should equal the default), with 128-row programs for the narrow
  # launches at 1-16 rows (fp8_narrow_block_o=128: o_proj's 75.7% at 16 rows) and at 33-64 rows
  # (fp8_verify_narrow_block_o=128: x slices twice the weight's bytes at 64 rows); then batch 16 K=3
  # with the better 33-64-row choice
  export CUDA_VISIBLE_DEVICES=0
  job gputests_tiles128 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_fp8_matmul.py -k 128_row
  local launches="python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_floor=false --fp8_launch_ms=1,4,16,40,64"
  job launches_t64 150 $launches --out=$R/launches_t64.json
  job launches_t128 150 $launches --kernels=fp8_tile_rows=128 --out=$R/launches_t128.json
  job launches_t128_narrow 150 $launches --kernels=fp8_tile_rows=128,fp8_narrow_block_o=128 \
    --out=$R/launches_t128_narrow.json
  job launches_t128_verify 150 $launches --kernels=fp8_tile_rows=128,fp8_verify_narrow_block_o=128 \
    --out=$R/launches_t128_verify.json
  # o_proj's tile sweep at 1 / 16 rows on 128-row tiles (the sweeps so far ran on the checkpoint layout)
  job oproj_sweep_t128 300 python3 -m pallas_kernels.bench --parts=fp8 --fp8_ms=1,16 --fp8_shapes=5120x6144 \
    --fp8_prefill_ms= --xla=false --fp8_sweep --fp8_sweep_match=x_f16=True --fp8_layout=tiled \
    --kernels=fp8_tile_rows=128 --out=$R/oproj_sweep_t128.json
  checkpoint27
  local bench="python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 --repeats=1 \
    --max_new_tokens=256 --breakdown=false --batch=16"
  job bench27_b16_t128_verify 260 $bench --kernels=fp8_tile_rows=128,fp8_verify_narrow_block_o=128 \
    --out=$R/bench27_b16_t128_verify.json
}

tall2() {  # a ~9-minute lease on one GPU (session 21, after tiles128 in the same lease): the decode grid
  # at 65-128 rows, 64-row programs on 64-row tiles and 128-row programs on 128-row tiles, against the
  # GEMM: launches at 96 / 128 rows, then batch 32 K=3 on the latter (session 20 on the GEMM: plain
  # 1952, K=3 profiled 2070 tok/s). Session 21 timed the former end to end by hand, the same bench
  # with --kernels=fp8_decode_max_rows=128 (3048 / 2335 tok/s natural / profiled).
  export CUDA_VISIBLE_DEVICES=0
  local launches="python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_floor=false --fp8_launch_ms=96,128"
  job launches_tall_gemm 100 $launches --kernels=fp8_decode_max_rows=64 --out=$R/launches_tall_gemm.json
  job launches_tall_decode 100 $launches --kernels=fp8_tile_rows=64 --out=$R/launches_tall_decode.json
  job launches_tall_decode_bo128 100 $launches --kernels=fp8_verify_narrow_block_o=128,fp8_verify_wide_block_o=128 \
    --out=$R/launches_tall_decode_bo128.json
  checkpoint27
  job bench27_b32_decode_bo128 330 python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --ks=3 \
    --repeats=1 --max_new_tokens=128 --breakdown=false --batch=32 \
    --kernels=fp8_verify_narrow_block_o=128 --out=$R/bench27_b32_decode_bo128.json
}

defaults21() {  # a ~24-minute lease on one GPU (start_defaults21, then wait twice; session 22's first):
  # session 21's defaults (128-row tiles, the wide launches on 128-row programs at 33-64 rows, the
  # decode grid to 128 rows) end to end and the last o_proj candidate. The tiled and tall `gpu` tests;
  # o_proj at 1 / 4 / 16 rows with split-K 4 (fp8_narrow_programs_per_sm=2: half the f32 partials it
  # writes at 16 rows, 1.3 against 2.6 MB) at 3 and 4 stages against the default; the 65-128-row
  # launches at 3 stages; batch 16 K=3, batch 32 K=1 / K=3, then batch 1 K=3 (the least needed: 1-16
  # rows measured unchanged on 128-row tiles), tokens equal plain in each
  export CUDA_VISIBLE_DEVICES=0
  job gputests_defaults21 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_fp8_matmul.py \
    -k "128_row or tall or tiled"
  local launches="python3 -m pallas_kernels.bench --parts=fp8_launches --fp8_launch_floor=false"
  job launches_narrow_default 100 $launches --fp8_launch_ms=1,4,16 --out=$R/launches_narrow_default.json
  job launches_narrow_split4 100 $launches --fp8_launch_ms=1,4,16 --kernels=fp8_narrow_programs_per_sm=2 \
    --out=$R/launches_narrow_split4.json
  # and with 4 stages (12 chunks per program at split-K 4): session 21's o_proj sweep on 128-row tiles had
  # split 4 / 4 stages fastest by wall time at 1 row (13.6 against 14.5-14.9 us per call, within its noise)
  job launches_narrow_split4_s4 100 $launches --fp8_launch_ms=1,4,16 \
    --kernels=fp8_narrow_programs_per_sm=2,fp8_narrow_num_stages=4 --out=$R/launches_narrow_split4_s4.json
  job launches_tall_s3 100 $launches --fp8_launch_ms=96,128 --kernels=fp8_verify_tall_stages=3 \
    --out=$R/launches_tall_s3.json
  checkpoint27
  local bench="python3 -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags --repeats=1 --breakdown=false"
  job bench27_b16 330 $bench --ks=3 --batch=16 --max_new_tokens=256 --out=$R/bench27_b16.json
  job bench27_b32 400 $bench --ks=1,3 --batch=32 --max_new_tokens=128 --out=$R/bench27_b32.json
  job bench27_b1 300 $bench --ks=3 --out=$R/bench27_b1.json
}

gpuall() {  # every `gpu` test at real sizes (16 at session 22), one job and log per file; the GDN,
  # conv and paged-attention files first: the FP8 kernel's ran at each of its changes, they last in
  # sessions 2, 8 and 12
  export CUDA_VISIBLE_DEVICES=0
  local f
  for f in tests/test_kernel_gdn.py tests/test_kernel_gdn_conv.py tests/test_kernel_paged_attention.py \
           tests/test_bench_device_time.py tests/test_kernel_fp8_matmul.py; do
    job gpu_$(basename $f .py) 300 python3 -m pytest -q -p no:cacheprovider -m gpu $f
  done
}

gputests() {  # a ~3-minute lease on one GPU: the FP8 kernel's `gpu` tests at the 27B shapes (gputests.log)
  export CUDA_VISIBLE_DEVICES=0
  job gputests 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_fp8_matmul.py
}

quick() {  # a short lease running one job function (start_X: X) in the background, then waiting
  local fn=$1
  rm -rf $R $SRC; mkdir -p $R; cp -r . $SRC
  cd $SRC || exit 1
  local site=""
  if ls .whl/*.whl >/dev/null 2>&1; then  # the server's wheels, where carried (see the top of this file)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && site=/tmp/site: || echo "server wheels did not install" >>$R/jobs.log
  fi
  export PYTHONPATH=$site$SRC JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 QMTP_CACHE=/tmp/qmtp_cache
  # all.done once the function returns, whatever it ran (wait_and_pack stops on it)
  setsid bash -c "$(declare -f job checkpoint27 tp1_over serve side_checks oproj_sweep tiled xchunk midrows narrow $fn); R=$R; $fn; touch $R/all.done" \
    </dev/null >$R/$fn.out 2>&1 &
  wait_and_pack
}

case $cmd in
  start_pieces|start_confirm|start_table|start_rows|start_floor|start_stages|start_oproj|start_gputests|start_tiles|start_tiled|start_xchunk|start_switches|start_midrows|start_narrow|start_stages64|start_batch32|start_tall|start_tiles128|start_tall2|start_defaults21|start_gpuall)
    quick "${cmd#start_}" ;;  # start_X runs the job function X() (see each)
  start)
    rm -rf $R $SRC; mkdir -p $R; cp -r . $SRC
    cd $SRC || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || echo "server wheels missing: the server jobs will fail" >>$R/jobs.log
    PYTHONPATH=/tmp/site python3 -c "import fastapi, uvicorn" 2>>$R/jobs.log || echo "server imports fail" >>$R/jobs.log
    export PYTHONPATH=/tmp/site:$SRC JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 QMTP_CACHE=/tmp/qmtp_cache
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader >$R/gpus.txt
    setsid bash -c "$(declare -f job serve gpu0); R=$R; gpu0" </dev/null >$R/gpu0.out 2>&1 &
    setsid bash -c "$(declare -f job gpu1); R=$R; gpu1" </dev/null >$R/gpu1.out 2>&1 &
    setsid bash -c "$(declare -f job both); R=$R; both" </dev/null >$R/both.out 2>&1 &
    ;&
  wait)
    wait_and_pack
    ;;
  serve_check)  # the server job on this machine (CPU: tiny preset), to check the script itself
    R=/tmp/qmtp_serve_check; rm -rf $R; mkdir -p $R
    SERVE_CKPT=preset:tiny SERVE_IMPL=ref SERVE_DTYPE=float32 serve 3 ${2:-8193} full
    cat $R/jobs.log; for f in $R/load_*.json; do python3 -c "import json,sys; r=json.load(open('$f')); print('$f', {k: r[k] for k in list(r)[:8]})"; done
    ;;
  *) echo "usage: $0 start|start_pieces|start_confirm|start_table|start_rows|start_floor|start_stages|start_oproj|start_gputests|start_tiles|start_tiled|start_xchunk|start_switches|start_midrows|start_narrow|start_stages64|wait [SECONDS] | serve_check [PORT]"; exit 2 ;;
esac
