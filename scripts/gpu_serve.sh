#!/usr/bin/env bash
# One device call: 27B-shaped controlled FP8 slice (4 layers), the server with MTP K=3 and plain, load tests.
# The GPU image lacks the server's packages: first `pip download --only-binary=:all: --python-version 3.12
# fastapi uvicorn jinja2 -d .whl` here, then run this through the device tool with carry=[".whl"].
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$(date +%s)
timeout 200 python3 -c "from qmtp.tools import make_checkpoint as m; print(m.write_checkpoint('/tmp/q27', 'qwen3_5_27b_controlled', 'fp8', num_layers=4, progress=False))" || exit 1
echo "checkpoint written in $(( $(date +%s) - t0 )) s"; du -sh /tmp/q27
serve() {  # K PORT
  local k=$1 port=$2 t=$(date +%s)
  python3 -m qmtp.server --checkpoint=/tmp/q27 --served_model_name=q27 --dtype=bfloat16 --impl=pallas --mtp_k=$k \
    --batch_slots=8 --rounds_per_call=8 --max_model_len=512 --max_tokens_limit=256 --port=$port \
    --warmup_prompt_lengths=16,32,64,128 --log_level=warning > $OUT/server_k$k.log 2>&1 &
  local pid=$!
  timeout 280 python3 -c "
import time, httpx
while True:
    try:
        if httpx.get('http://127.0.0.1:$port/health', timeout=1).status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(1)" || { echo "server K=$k did not come up"; tail -20 $OUT/server_k$k.log; kill $pid; return; }
  echo "server K=$k up after $(( $(date +%s) - t )) s"
  timeout 120 python3 scripts/load_test.py --url=http://127.0.0.1:$port --requests=128 --concurrency=8 \
    --prompt_tokens=16,128 --max_tokens=64 --output_json=$OUT/load_k$k.json
  timeout 120 python3 scripts/load_test.py --url=http://127.0.0.1:$port --requests=64 --concurrency=8 \
    --prompt_tokens=16,128 --max_tokens=64 --stream --seed=1 --output_json=$OUT/load_k${k}_stream.json
  timeout 60 python3 scripts/load_test.py --url=http://127.0.0.1:$port --requests=64 --concurrency=1 \
    --prompt_tokens=64,64 --max_tokens=64 --seed=2 --output_json=$OUT/load_k${k}_c1.json
  python3 -c "import httpx; print(httpx.get('http://127.0.0.1:$port/metrics').text)" > $OUT/metrics_k$k.txt
  kill -TERM $pid; wait $pid; echo "server K=$k exit status $?"
}
serve 3 8003
serve 0 8000
