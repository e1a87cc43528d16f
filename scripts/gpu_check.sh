#!/usr/bin/env bash
# The GPU checks of qmtp on an H200 machine: the `gpu`-marked kernel tests and the benchmark table
# (27B-shaped FP8 controlled checkpoint, one GPU, batch 1 and batch 16).
#
#   bash scripts/gpu_check.sh [STEP ...]      STEP: one of ALL_STEPS below (default: all of them, in that order)
#
# Run from the repository root. Results and logs go under $OUT (default ./out): one log per step,
# $OUT/<step>.log, ending with rc=N (124: the step hit its time limit), the exactness JSON files and the
# bench JSON files $OUT/bench_tp1_b1.json / bench_tp1_b16.json (the README's table). Each step has its own time
# limit (seconds; override with LIMIT_<step>=N) so a slow one cannot eat the others. The first bench
# on a fresh machine also writes the ~30 GB checkpoint into the cache (H200: ~45 s, then ~30 s to load). A device call
# limited to 10 minutes holds one step at these limits: name the steps one call at a time.
# BENCH_ARGS is appended to every step that ends in a qmtp.bench command (bench_*), BENCH_ARGS_<step> to
# that step's instead (BENCH_ARGS_bench_long=--prompt_lengths=8192 leaves bench_sampling alone in one
# call): the flagfile's whole table (K=1..4, 3 repeats, the round breakdown) takes about 11 minutes at
# batch 1; BENCH_ARGS="--ks=3 --repeats=1 --breakdown=false" is the shorter run behind the README's
# rows. PYTHON: interpreter (python3).
# PROFILE=1: the chat_* and decode_* steps also trace the server's device work over the load and summarize
# it (scripts/trace_summary.py) into $OUT/<step>_trace.txt. SERVER_ARGS / LOAD_ARGS are appended to those
# steps' server / load_test.py flags (a later flag wins: LOAD_ARGS=--system_tokens=2000).
# The server steps (serve_*, chat_*) need fastapi, uvicorn and httpx: where the machine lacks them, run
# `make device-wheels` here and carry .device-wheels along.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. JAX_PLATFORMS=cuda
OUT=${OUT:-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
ALL_STEPS=(kernel_tests row_layers exactness_demo exactness_27b bench_b1 bench_b16 bench_long bench_131k prefill_trace
           prefill_chunks prefill_memory serve_long fp8_gemm_rows gdn_prefill attn_prefill bench_sampling sampling_ops sampling_trace
           bench_deterministic chat_nocache chat_prefix decode_nocache decode_prefix prefix_blocks loop_trace bench_auto serve_k0
           serve_kauto moe_trace moe_sweep bench_moe bench_moe_vocab warmup_threads)
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=("${ALL_STEPS[@]}")

run_step() {  # name default_limit_s command...
  local name=$1 var="LIMIT_$1"
  local limit=${!var:-$2}
  shift 2
  echo "== $name (limit ${limit}s, log $OUT/$name.log)"
  local start=$SECONDS rc
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "took $((SECONDS - start)) s" >>"$OUT/$name.log"
  echo "rc=$rc" >>"$OUT/$name.log"
  tail -n 5 "$OUT/$name.log" | cut -c1-300
}

# The server steps' packages (fastapi, uvicorn, httpx): the machine's own, else the wheels of `make device-wheels`
# carried in .device-wheels/, unpacked once and put after everything else on PYTHONPATH.
SERVER_STEPS=" serve_long chat_nocache chat_prefix decode_nocache decode_prefix prefix_blocks serve_k0 serve_kauto warmup_threads "
server_packages() {
  "$PY" -c "import fastapi, uvicorn, httpx" 2>/dev/null && return 0
  local site=${TMPDIR:-/tmp}/qmtp_server_packages wheel
  if ! ls .device-wheels/*.whl >/dev/null 2>&1; then
    echo "server steps need fastapi, uvicorn and httpx: run 'make device-wheels' and carry .device-wheels" >&2
    return 1
  fi
  for wheel in .device-wheels/*.whl; do "$PY" -m zipfile -e "$wheel" "$site" || return 1; done
  export PYTHONPATH="$PYTHONPATH:$site"
  "$PY" -c "import fastapi, uvicorn, httpx"
}

BENCH=("$PY" -m qmtp.bench --flagfile=configs/bench_27b_fp8_tp1.flags)
status=0
for s in "${steps[@]}"; do
  step_args="BENCH_ARGS_$s"
  read -r -a EXTRA <<<"${!step_args-${BENCH_ARGS:-}}"
  if [[ $SERVER_STEPS == *" $s "* ]] && ! server_packages; then
    echo "== $s: skipped (no server packages)"; status=1; continue
  fi
  case $s in
    kernel_tests) run_step kernel_tests 540 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_*.py \
                    tests/test_row_invariance.py ;;
    # where a row's numbers part from its batch or its verify pass, layer by layer (27B FP8 preset, 8 layers)
    row_layers) run_step row_layers 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_row_invariance_model.py ;;
    # greedy tokens in bfloat16 with --deterministic: the demo on 32 code prompts (batch 1 / 8 / 32, K = 1..4)
    exactness_demo) run_step exactness_demo 580 "$PY" -m qmtp.bench.exactness --impl=pallas --deterministic \
                      --prompts=32 --batch=1,8,32 --out="$OUT/exactness_demo.json" ;;
    # ... and the random (flat-logit) 27B-shaped FP8 preset, 8 layers, 32 prompts x 128 tokens, K = 1..4
    exactness_27b) run_step exactness_27b 580 "$PY" -m qmtp.bench.exactness --checkpoint=preset:qwen3_5_27b:fp8 \
                     --num_layers=8 --impl=pallas --deterministic --prompts=32 --max_new_tokens=128 --batch=1,8,32 \
                     --ks=1,2,3,4 --out="$OUT/exactness_27b.json" ;;
    bench_b1) run_step bench_b1 580 "${BENCH[@]}" --out="$OUT/bench_tp1_b1.json" "${EXTRA[@]}" ;;
    bench_b16) run_step bench_b16 420 "${BENCH[@]}" --batch=16 --max_new_tokens=256 --ks=3 \
                 --out="$OUT/bench_tp1_b16.json" "${EXTRA[@]}" ;;
    # long prompts: TTFT and prefill rate at 32k and 8k (chunked prefill), decode after them, K=3 profiled
    # (32k first: H200, 8k took ~250 s of compiles and runs, 32k plain alone ~130 s; the 32k rows come first)
    bench_long) run_step bench_long 580 "${BENCH[@]}" --prompt_lengths=32768,8192 --ks=3 --repeats=1 \
                  --breakdown=false --max_new_tokens=256 --out="$OUT/bench_tp1_long.json" "${EXTRA[@]}" ;;
    # 131,072 prompt tokens: TTFT and peak memory (target <= 80 GB), then plain and K=3 decoding after it
    bench_131k) run_step bench_131k 580 "${BENCH[@]}" --prompt_lengths=131072 --ks=3 --repeats=1 --breakdown=false \
                  --max_new_tokens=64 --out="$OUT/bench_tp1_131k.json" "${EXTRA[@]}" ;;
    # where an 8k prefill's device time goes (the 27B preset's first 8 layers: 6 GDN, 2 attention), by kernel
    prefill_trace) run_step prefill_trace 240 bash -c "rm -rf /tmp/qmtp_prefill_trace; $PY -m qmtp.bench \
                     --checkpoint=preset:qwen3_5_27b:fp8 --num_layers=8 --prompt_lengths=8192 --ks= --repeats=1 \
                     --breakdown=false --max_new_tokens=4 --trace_dir=/tmp/qmtp_prefill_trace --out=$OUT/prefill_trace.json \
                     && $PY scripts/trace_summary.py /tmp/qmtp_prefill_trace/* --top=20" ;;
    # the 8k TTFT at prefill chunks of 2048, 4096 and 8192 tokens (8 layers: the default chunk by measurement)
    prefill_chunks) run_step prefill_chunks 300 bash -c "for c in 2048 4096 8192; do $PY -m qmtp.bench \
                      --checkpoint=preset:qwen3_5_27b:fp8 --num_layers=8 --prompt_lengths=8192 --ks= --repeats=3 \
                      --breakdown=false --max_new_tokens=4 --prefill_chunk=\$c --out=$OUT/prefill_chunk_\$c.json \
                      2>&1 | grep -E 'repeat|TTFT|rror' || exit 1; done" ;;
    # what a 32k prefill's device memory holds at its peak (8 layers): XLA's memory-usage report of the prefill
    # program, its largest buffers with their shapes, in $OUT/prefill_memory/
    prefill_memory) run_step prefill_memory 300 bash -c "rm -rf /tmp/qmtp_prefill_dump; XLA_FLAGS='--xla_dump_to=/tmp/qmtp_prefill_dump \
                      --xla_dump_hlo_module_re=.*prefill.*' $PY -m qmtp.bench --checkpoint=preset:qwen3_5_27b:fp8 --num_layers=8 \
                      --prompt_lengths=32768 --ks= --repeats=1 --breakdown=false --max_new_tokens=4 \
                      --out=$OUT/prefill_memory.json && mkdir -p $OUT/prefill_memory \
                      && cp /tmp/qmtp_prefill_dump/*memory-usage-report.txt $OUT/prefill_memory/ \
                      && head -n 30 \$(ls -S /tmp/qmtp_prefill_dump/*memory-usage-report.txt | head -n 1)" ;;
    # 4 streams decoding, one 32k prompt arriving after 20 s (prefilled piece by piece: while the streams
    # decode, pieces of SERVE_LONG_PIECE tokens, the server's --interleave_piece; 0: its default, 128):
    # their inter-token gaps. The streams' prompts (17-32 tokens) all take bucket 32: at 27B each prompt
    # bucket's two programs take ~90 s of the warm-up
    serve_long) run_step serve_long 580 bash -c "$PY -m qmtp.server --checkpoint=preset:qwen3_5_27b_controlled:fp8 \
                  --impl=pallas --mtp_k=0 --batch_slots=5 --max_model_len=33024 --warmup_buckets=32,32768 --port=8123 \
                  --interleave_piece=${SERVE_LONG_PIECE:-0} \
                  >$OUT/serve_long_server.log 2>&1 & server=\$!; $PY scripts/load_test.py --url=http://127.0.0.1:8123 \
                  --concurrency=4 --requests=100000 --duration_s=90 --prompt_tokens=17,32 --max_tokens=128 --stream \
                  --long_prompt_tokens=32768 --long_prompt_after_s=20 --vocab=4096 --output_json=$OUT/serve_long.json; \
                  rc=\$?; kill \$server; wait \$server; exit \$rc" ;;
    # the FP8 projections of a serving piece while others decode (--interleave_piece 256, 512: the GEMM; 128 takes
    # the decode grid): each 27B shape's default tile against the sweep's candidates and XLA's dequantize + dot
    fp8_gemm_rows) run_step fp8_gemm_rows 560 "$PY" -m pallas_kernels.bench --parts=fp8 --fp8_ms= \
                     --fp8_prefill_ms=256,512 --fp8_sweep --out="$OUT/fp8_gemm_rows.json" ;;
    # the chunked GDN prefill at the 27B shapes, T = 512 and 4096, its chain over chunks as a lax.scan (xla)
    # and as one kernel (pallas; a tile / warps sweep), against the layer's matmuls, at WY chunks of 32, 64;
    # and the chunk-parallel half alone (wy_inputs)
    gdn_prefill) run_step gdn_prefill 300 "$PY" -m pallas_kernels.bench --parts=gdn --gdn_cases=prefill \
                   --gdn_prefill_chunks=32,64 --gdn_chain_configs=64x8,32x4,16x4,32x8 \
                   --out="$OUT/gdn_prefill.json" ;;
    # prefill attention: a 2048-token chunk and a 128-token serving piece at the end of 8k and 32k prompts, per
    # query-tile config
    attn_prefill) run_step attn_prefill 300 "$PY" -m pallas_kernels.bench --parts=attention --attention_cases=prefill \
                    --attention_prefill_tokens=2048,128 --out="$OUT/attn_prefill.json" ;;
    # sampling's cost: Qwen's recommended settings, each mode beside its greedy twin in the same run (batch 1, K=3)
    bench_sampling) run_step bench_sampling 580 "${BENCH[@]}" --ks=3 --profile= --repeats=1 --breakdown=false \
                      --temperature=0.6 --top_p=0.95 --top_k=20 --sampling_cost --out="$OUT/bench_tp1_sampling.json" \
                      "${EXTRA[@]}" ;;
    # sampling's pieces alone at the 248,320-id vocabulary (1, 4, 16 rows): each cut, the draw, the acceptance,
    # and a K=3 round's sampling work against a greedy round's argmaxes (no checkpoint: ~1 minute)
    sampling_ops) run_step sampling_ops 240 "$PY" -m qmtp.bench.sampling_ops --out="$OUT/sampling_ops.json" ;;
    # where sampling's extra time in a round goes: plain and K=3, sampled and greedy, each traced (8 layers)
    sampling_trace) run_step sampling_trace 400 bash -c "rm -rf /tmp/qmtp_sampling_trace; $PY -m qmtp.bench \
                      --checkpoint=preset:qwen3_5_27b_controlled:fp8 --engine=pallas --num_layers=8 --ks=3 --profile= \
                      --repeats=1 --breakdown=false --max_new_tokens=256 --temperature=0.6 --top_p=0.95 --top_k=20 \
                      --sampling_cost --trace_dir=/tmp/qmtp_sampling_trace --out=$OUT/sampling_trace.json \
                      && for d in /tmp/qmtp_sampling_trace/*; do $PY scripts/trace_summary.py \$d --top=40; done" ;;
    # the cost of --deterministic: both engines on the same weights, batch 1 and 16
    bench_deterministic) run_step bench_deterministic 580 "${BENCH[@]}" --engine=pallas,deterministic --ks=3 \
                           --repeats=1 --breakdown=false --batch=1,16 --max_new_tokens=256 \
                           --out="$OUT/bench_tp1_deterministic.json" "${EXTRA[@]}" ;;
    # the prefix cache's steps, each pair without and with the cache on one server setup (the 27B preset's first
    # CHAT_LAYERS layers, default 16 of 64: ~4x shorter compiles; K=3, 8 slots); the *_prefix step after its
    # *_nocache one in a call also reports its figures as ratios to those. chat: 8 conversations of 8 turns
    # (2048-token system prompt, 200 user tokens and 200 generated per turn): time to first token per turn
    # (H100: chat_nocache ~100 s, chat_prefix ~100-130 s with its warm-up). decode: the cost to decoding, 8
    # clients, 256 distinct prompts (17-32 tokens: nothing to reuse), 200 tokens each (~20 s): inter-token gaps, tok/s
    chat_nocache|chat_prefix|decode_nocache|decode_prefix)
      kind=${s%_*}; cache=(); compare=(); profile=(); summary=true
      if [ "${PROFILE:-0}" = 1 ]; then  # a device trace over the load, summarized into $OUT/<step>_trace.txt
        profile=(--profile); summary="$PY scripts/trace_summary.py $OUT/${s}_profile >$OUT/${s}_trace.txt"
      fi
      [ "${s#*_}" = nocache ] && cache=(--prefix_cache_bytes=0)  # *_prefix: the default, sized by the warm-up
      [ "${s#*_}" = prefix ] && [ -f "$OUT/${kind}_nocache.json" ] && compare=(--compare_to="$OUT/${kind}_nocache.json")
      if [ "$kind" = chat ]; then
        buckets=4096; load="--requests=64 --turns=8 --system_tokens=2048 --systems=1 --prompt_tokens=200,200"
      else
        buckets=32; load="--requests=256 --prompt_tokens=17,32"
      fi
      run_step "$s" 580 bash -c "$PY -m qmtp.server --checkpoint=preset:qwen3_5_27b_controlled:fp8 --impl=pallas \
                 --num_layers=${CHAT_LAYERS:-16} --mtp_k=3 --batch_slots=8 --max_model_len=8192 \
                 --warmup_buckets=$buckets --port=8124 --profile_dir=$OUT/${s}_profile ${cache[*]} ${SERVER_ARGS:-} \
                 >$OUT/${s}_server.log 2>&1 & server=\$!; \
                 $PY scripts/load_test.py --url=http://127.0.0.1:8124 --concurrency=8 $load ${profile[*]} \
                 --max_tokens=200 --stream --vocab=4096 --output_json=$OUT/$s.json ${compare[*]} ${LOAD_ARGS:-}; rc=\$?; \
                 kill \$server; wait \$server; $summary; exit \$rc" ;;
    # the prefix cache's block (--prefix_block) at 16, 64 and 256 tokens, one server start each on chat_prefix's setup
    # with a shorter load (8 conversations of 2 turns, a 2000-token system prompt): TTFT per turn and hits in
    # $OUT/prefix_block_<B>.json (the first start writes the checkpoint and compiles: ~170 s, the others ~60 s; H100)
    prefix_blocks) run_step prefix_blocks 580 bash -c "for b in 16 64 256; do $PY -m qmtp.server \
                     --checkpoint=preset:qwen3_5_27b_controlled:fp8 --impl=pallas --num_layers=${CHAT_LAYERS:-16} \
                     --mtp_k=3 --batch_slots=8 --max_model_len=8192 --warmup_buckets=4096 --port=8127 --prefix_block=\$b \
                     >$OUT/prefix_block_\${b}_server.log 2>&1 & server=\$!; $PY scripts/load_test.py \
                     --url=http://127.0.0.1:8127 --concurrency=8 --requests=16 --turns=2 --system_tokens=2000 --systems=1 \
                     --prompt_tokens=200,200 --max_tokens=200 --stream --vocab=4096 --output_json=$OUT/prefix_block_\$b.json; \
                     rc=\$?; kill \$server; wait \$server; [ \$rc = 0 ] || exit \$rc; done" ;;
    # the decode_* steps' loop (the 27B preset's first 16 layers, 8 sequences, K=3, 200 tokens) in the bench, not
    # the server: plain and K=3 traced, by program and idle gap; beside decode_nocache's trace it tells the
    # loop's own idle time from the server's
    loop_trace) run_step loop_trace 400 bash -c "rm -rf /tmp/qmtp_loop_trace; ${BENCH[*]} \
                  --checkpoint=preset:qwen3_5_27b_controlled:fp8 --num_layers=16 --batch=8 --ks=3 --profile= \
                  --repeats=1 --breakdown=false --max_new_tokens=200 --trace_dir=/tmp/qmtp_loop_trace \
                  --out=$OUT/loop_trace.json && for d in /tmp/qmtp_loop_trace/*; do $PY scripts/trace_summary.py \$d; done" ;;
    # the draft length chosen per round against plain, K=1 and K=3 at batch 16 and 32 (natural and profiled);
    # other batches one call each (BENCH_ARGS=--batch=N: over 270 s a batch on an H100: load, then each mode compiles;
    # 64 at K=3 wants an H200's memory)
    bench_auto) run_step bench_auto 580 "${BENCH[@]}" --ks=1,3 --auto --repeats=1 --breakdown=false --batch=16,32 \
                  --max_new_tokens=128 --out="$OUT/bench_tp1_auto.json" "${EXTRA[@]}" ;;
    # the server under 32 concurrent clients, plain and with the draft length chosen per round: output tok/s
    # (prompts of 17-32 tokens: one prompt bucket to compile)
    serve_k0|serve_kauto)
      k=0; [ "$s" = serve_kauto ] && k=auto
      run_step "$s" 580 bash -c "$PY -m qmtp.server --checkpoint=preset:qwen3_5_27b_controlled:fp8 --impl=pallas \
                 --mtp_k=$k --batch_slots=32 --max_model_len=512 --warmup_buckets=32 --port=8125 \
                 >$OUT/${s}_server.log 2>&1 & server=\$!; $PY scripts/load_test.py --url=http://127.0.0.1:8125 \
                 --concurrency=32 --requests=512 --duration_s=120 --prompt_tokens=17,32 --max_tokens=128 --vocab=4096 \
                 --output_json=$OUT/$s.json; rc=\$?; kill \$server; wait \$server; exit \$rc" ;;
    # where a plain MoE decode step's device time goes (35B-A3B-shaped FP8, 8 layers, batch 1), by kernel
    moe_trace) run_step moe_trace 300 bash -c "rm -rf /tmp/qmtp_moe_trace; ${BENCH[*]} \
                 --checkpoint=preset:qwen3_5_35b_a3b_controlled:fp8 --num_layers=8 --ks= --repeats=1 --breakdown=false \
                 --max_new_tokens=32 --trace_dir=/tmp/qmtp_moe_trace --out=$OUT/moe_trace.json \
                 && $PY scripts/trace_summary.py /tmp/qmtp_moe_trace/* --top=30" ;;
    # the expert matmul's tiles at the 35B-A3B shapes (decode and verify blocks): default vs candidates; a
    # 2048-token prefill chunk at 16-128-row blocks against XLA's ragged dot (dequantizing in each call or before)
    moe_sweep) run_step moe_sweep 300 "$PY" -m pallas_kernels.bench --parts=moe --moe_sweep --out="$OUT/moe_sweep.json" ;;
    # the 35B-A3B-shaped FP8 MoE (first 8 of its 40 layers, controlled acceptance): plain and K=3 at batch 1, 8, 32
    # (1024 new tokens: at 128 the K=3 profile is not realized, too few rounds)
    bench_moe) run_step bench_moe 580 "${BENCH[@]}" --checkpoint=preset:qwen3_5_35b_a3b_controlled:fp8 --num_layers=8 --ks=3 \
                 --repeats=1 --breakdown=false --batch=1,8,32 --max_new_tokens=1024 --out="$OUT/bench_moe.json" "${EXTRA[@]}" ;;
    # ... at batch 1 with drafts over a 32,768-id vocabulary (ids 0-32767: they hold the controlled tokenizer's 384,
    # so acceptance is unchanged): each draft step reads 1/8 of the 0.5 GB FP8 draft head (bytes bound 1.23x -> 1.87x)
    bench_moe_vocab) run_step bench_moe_vocab 400 bash -c "$PY -c 'import json; json.dump(list(range(32768)), \
                       open(\"/tmp/qmtp_draft_vocab.json\", \"w\"))' && ${BENCH[*]} \
                       --checkpoint=preset:qwen3_5_35b_a3b_controlled:fp8 --num_layers=8 --ks=3 --repeats=1 --breakdown=false \
                       --batch=1 --max_new_tokens=1024 --draft_vocab=/tmp/qmtp_draft_vocab.json --out=$OUT/bench_moe_vocab.json" ;;
    # the server's warm-up (the 27B preset's first 8 layers, K=3, bucket 32, no compile cache) compiling one
    # program at a time and on 8 threads: each start's log lines from "warm-up" on, until it reports done
    warmup_threads) run_step warmup_threads 290 bash -c "for t in 1 8; do $PY -m qmtp.server \
                      --checkpoint=preset:qwen3_5_27b_controlled:fp8 --num_layers=8 --impl=pallas --mtp_k=3 \
                      --batch_slots=8 --max_model_len=4096 --warmup_buckets=32 --compile_cache= --warmup_threads=\$t \
                      --port=8126 >$OUT/warmup_threads_\$t.log 2>&1 & server=\$!; \
                      until grep -q 'warm-up done' $OUT/warmup_threads_\$t.log; do kill -0 \$server || exit 1; sleep 1; done; \
                      kill \$server; wait \$server; grep -E 'warm-up' $OUT/warmup_threads_\$t.log; done" ;;
    *) echo "unknown step '$s' (${ALL_STEPS[*]})"; exit 2 ;;
  esac
  tail -n 1 "$OUT/$s.log" | grep -qx 'rc=0' || status=1
done
exit $status
