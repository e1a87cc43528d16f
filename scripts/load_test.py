"""Bounded load test of an OpenAI-compatible server (python -m qmtp.server, or any other).

    python scripts/load_test.py --url=http://127.0.0.1:8000 --requests=256 --concurrency=16 \
        --prompt_tokens=32,512 --max_tokens=64 [--stream] [--output_json=load.json]

`concurrency` clients each send requests one after another until `requests` were sent or
`duration_s` passed (whichever first), once GET /health answers 200. Prompts are random token-id lists (lengths uniform in the
--prompt_tokens range, seeded), so no tokenizer is needed and every prompt is distinct (no
prefix cache hits unless --repeat_prompts). Reports requests/s, generated tokens/s, latency percentiles
(p50/p90/p99 of the whole request; with --stream also of the time to first token and of the
inter-token gap: the time between two streamed chunks of one request, each holding the tokens of
one engine call), the errors by HTTP status, and what the server's unlabelled counters from GET
/metrics (a qmtp server's prefills, prefill passes, loop calls, rounds, ...) grew by during the load
(printed: prompts prefilled, passes, rows a pass, decode calls).
Exit status 1 when any request failed.

--turns=T makes each client hold conversations of T turns instead: turn t's prompt is the whole
conversation so far (an optional --system_tokens prefix, one of --systems, then each turn's user
tokens and the ids the server generated) plus new --prompt_tokens user tokens (a client starts no
conversation that --requests cannot finish); the report adds, per turn, the prompt length and the
time to first token (what a prefix cache saves), and the server's prefix cache counters from GET
/metrics when it has them. --compare_to=FILE (an earlier run's --output_json, e.g. without the
prefix cache) adds each turn's time to first token, the generated tok/s and the inter-token gap p50
as ratios to that run's.

--long_prompt_tokens=N (with --stream) sends one more request, with an N-token prompt,
--long_prompt_after_s after the start, and reports its time to first token and the other requests'
inter-token gaps while it was prefilled (from its sending to its first token) next to those of the
whole run: what a long prompt arriving costs the streams already running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--requests", type=int, default=64, help="total requests (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending at once (default %(default)s)")
    p.add_argument("--duration_s", type=float, default=300.0, help="stop sending after this many seconds "
                   "(default %(default)s)")
    p.add_argument("--prompt_tokens", default="16,128", help="MIN,MAX prompt length in tokens (default %(default)s)")
    p.add_argument("--max_tokens", type=int, default=32, help="max_tokens of every request (default %(default)s)")
    p.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn from [0, vocab) (default %(default)s)")
    p.add_argument("--repeat_prompts", type=int, default=0, help="draw prompts from a pool of this many "
                   "(0 = every prompt distinct)")
    p.add_argument("--stream", action="store_true", help="stream (SSE) and measure time to first token")
    p.add_argument("--timeout_s", type=float, default=600.0, help="per-request timeout (default %(default)s)")
    p.add_argument("--wait_ready_s", type=float, default=600.0, help="wait up to this long for GET /health to "
                   "answer 200 (a server warming up answers 503) before sending (default %(default)s)")
    p.add_argument("--long_prompt_tokens", type=int, default=0, help="also send one request with a prompt of this "
                   "many tokens (0: none; needs --stream)")
    p.add_argument("--long_prompt_after_s", type=float, default=5.0, help="send the long prompt this many seconds "
                   "after the start (default %(default)s)")
    p.add_argument("--turns", type=int, default=1, help="turns per conversation (1: independent requests)")
    p.add_argument("--system_tokens", type=int, default=0, help="with --turns: each conversation starts with one of "
                   "--systems prompts of this many tokens (default %(default)s)")
    p.add_argument("--systems", type=int, default=1, help="distinct system prompts (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="trace the server's device work over the load: POST "
                   "/start_profile before the first request and /stop_profile after the last (the server needs "
                   "--profile_dir)")
    p.add_argument("--output_json", default=None, help="also write the report here")
    p.add_argument("--compare_to", default=None, help="an earlier run's --output_json (e.g. the same load without "
                   "the prefix cache): each turn's time to first token and the generated tok/s beside its, as ratios")
    args = p.parse_args(argv)
    try:
        lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    except ValueError:
        p.error(f"--prompt_tokens={args.prompt_tokens!r}: expected MIN,MAX")
    if not 1 <= lo <= hi or args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("need 1 <= MIN <= MAX, --requests >= 1, --concurrency >= 1, --max_tokens >= 1")
    if args.long_prompt_tokens < 0 or (args.long_prompt_tokens and not args.stream):
        p.error("--long_prompt_tokens needs --stream and a value >= 0")
    if not 1 <= args.turns <= args.requests or args.system_tokens < 0 or args.systems < 1:
        p.error("need 1 <= --turns <= --requests, --system_tokens >= 0, --systems >= 1")
    args.prompt_range = (lo, hi)
    return args


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(values)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]  # noqa: E731 (nearest rank)
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "mean": sum(s) / len(s)}


async def one_request(client: httpx.AsyncClient, args, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    if not args.stream:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "latency_s": time.perf_counter() - t0}
        ids = r.json()["choices"][0].get("token_ids", [])
        return {"ok": True, "latency_s": time.perf_counter() - t0, "tokens": r.json()["usage"]["completion_tokens"],
                "ids": ids}
    body["stream"] = True
    ttft, tokens, arrivals, ids = None, 0, [], []  # arrivals: perf_counter() of each chunk holding tokens
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "status": r.status_code, "latency_s": time.perf_counter() - t0}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ok": False, "status": "stream_error", "latency_s": time.perf_counter() - t0}
            new = [t for c in chunk.get("choices", []) for t in c.get("token_ids", [])]
            ids += new
            n = len(new)
            if n:
                arrivals.append(time.perf_counter())
            if n and ttft is None:
                ttft = arrivals[-1] - t0
            tokens += n
    return {"ok": True, "latency_s": time.perf_counter() - t0, "ttft_s": ttft, "tokens": tokens, "sent": t0,
            "gaps": [(b - a, b) for a, b in zip(arrivals, arrivals[1:])], "ids": ids}  # gaps: (gap s, its end)


async def wait_ready(client: httpx.AsyncClient, limit_s: float) -> None:
    """Polls GET /health until it answers 200 (the server has compiled its programs)."""
    deadline, last = time.perf_counter() + limit_s, None
    while time.perf_counter() < deadline:
        try:
            r = await client.get("/health")
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        await asyncio.sleep(1.0)
    raise SystemExit(f"error: {client.base_url}/health did not answer 200 within --wait_ready_s={limit_s:g} "
                     f"(last: {last})")


async def metric_samples(client: httpx.AsyncClient) -> dict:
    """The server's unlabelled samples from GET /metrics, name -> value ({} when it has none)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    samples = (line.split(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples if "{" not in name}


def counters(samples: dict) -> dict:
    """The `*_total` samples (counters) of metric_samples."""
    return {name: v for name, v in samples.items() if name.endswith("_total")}


async def profile(client: httpx.AsyncClient, action: str) -> str:
    """POST /start_profile or /stop_profile: the server's profile directory; exits with its error."""
    r = await client.post(f"/{action}_profile")
    if r.status_code != 200:
        raise SystemExit(f"error: --profile: POST /{action}_profile answered {r.status_code}: {r.text}")
    return r.json()["profile_dir"]


async def run(args) -> dict:
    rng = random.Random(args.seed)
    pool = None
    if args.repeat_prompts:
        pool = [[rng.randrange(args.vocab) for _ in range(rng.randint(*args.prompt_range))]
                for _ in range(args.repeat_prompts)]
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout_s, limits=limits) as client:
        await wait_ready(client, args.wait_ready_s)
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        counters_before = counters(await metric_samples(client))
        if args.profile:
            await profile(client, "start")
        taken, results = 0, []  # requests taken by the clients' conversations (each one its turns)
        start = time.perf_counter()

        systems = [[rng.randrange(args.vocab) for _ in range(args.system_tokens)] for _ in range(args.systems)]

        async def worker():
            nonlocal taken
            turn, history = args.turns, []
            while time.perf_counter() - start < args.duration_s:
                if turn == args.turns:  # a new conversation (each request one, without --turns)
                    if taken + args.turns > args.requests:  # --requests could not finish it: not started
                        break
                    taken += args.turns
                    turn, history = 0, list(rng.choice(systems))
                user = (rng.choice(pool) if pool else
                        [rng.randrange(args.vocab) for _ in range(rng.randint(*args.prompt_range))])
                prompt = history + user
                try:
                    result = await one_request(client, args, model, prompt)
                except httpx.HTTPError as e:
                    result = {"ok": False, "status": type(e).__name__, "latency_s": 0.0}
                results.append({**result, "turn": turn, "prompt_tokens": len(prompt)})
                history, turn = prompt + result.get("ids", []), turn + 1

        async def long_prompt():
            await asyncio.sleep(args.long_prompt_after_s)
            prompt = [rng.randrange(args.vocab) for _ in range(args.long_prompt_tokens)]
            try:
                return await one_request(client, args, model, prompt)
            except httpx.HTTPError as e:
                return {"ok": False, "status": type(e).__name__, "latency_s": 0.0}

        tasks = [worker() for _ in range(args.concurrency)]
        long = asyncio.ensure_future(long_prompt()) if args.long_prompt_tokens else None
        await asyncio.gather(*tasks)
        long = await long if long is not None else None
        elapsed = time.perf_counter() - start
        if args.profile:
            print(f"profile written to {await profile(client, 'stop')}", flush=True)
        samples = await metric_samples(client)
    prefix_cache = {n.removeprefix("qmtp_prefix_cache_"): v for n, v in samples.items()
                    if n.startswith("qmtp_prefix_cache_")}
    counters_after = counters(samples)
    ok = [r for r in results if r["ok"]]
    errors: dict = {}
    for r in results:
        if not r["ok"]:
            errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
    tokens = sum(r["tokens"] for r in ok)
    report = {"url": args.url, "model": model, "requests": len(results), "succeeded": len(ok), "errors": errors,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_range,
              "stream": args.stream, "elapsed_s": elapsed, "requests_per_s": len(ok) / elapsed,
              "generated_tokens": tokens, "tokens_per_s": tokens / elapsed,
              "latency_s": percentiles([r["latency_s"] for r in ok])}
    if counters_after:  # what the load added (the warm-up's calls came before)
        report["server_counters"] = {n: v - counters_before.get(n, 0.0) for n, v in counters_after.items()}
    if args.stream:
        report["ttft_s"] = percentiles([r["ttft_s"] for r in ok if r.get("ttft_s") is not None])
        gaps = [g for r in ok for g in r["gaps"]]
        report["inter_token_s"] = percentiles([g for g, _ in gaps])
    if args.turns > 1:
        report["turns"] = [{"turn": t, "requests": len(rs), "prompt_tokens_mean": sum(r["prompt_tokens"] for r in rs)
                            / len(rs), "ttft_s": percentiles([r["ttft_s"] for r in rs if r.get("ttft_s") is not None]),
                            "latency_s": percentiles([r["latency_s"] for r in rs])}
                           for t in range(args.turns) if (rs := [r for r in ok if r["turn"] == t])]
        report["prefix_cache"] = prefix_cache
    if long is not None:
        report["long_prompt"] = {"prompt_tokens": args.long_prompt_tokens, "generated_tokens": long.get("tokens"),
                                 **{k: long.get(k) for k in ("ok", "status", "ttft_s", "latency_s")}}
        if long["ok"]:  # the other streams' gaps that ended while the long prompt waited for its first token
            window = (long["sent"], long["sent"] + long["ttft_s"])
            during = [g for g, end in gaps if window[0] <= end <= window[1]]
            report["inter_token_s_during_long_prefill"] = {**percentiles(during), "count": len(during),
                                                           "max": max(during, default=None)}
        else:
            errors[str(long["status"])] = errors.get(str(long["status"]), 0) + 1
    return report


def compare(report: dict, base: dict) -> dict:
    """This run beside an earlier one (--compare_to): generated tok/s and (streamed) the inter-token gap p50
    over its, and per turn both in the two runs, time to first token p50 over its (turns of the same
    number: the same history length when both runs sent the same conversations)."""
    ratio = lambda a, b: None if a is None or not b else a / b  # noqa: E731
    theirs = {t["turn"]: t for t in base.get("turns", [])}
    turns = [{"turn": t["turn"], "ttft_p50_s": t["ttft_s"]["p50"], "base_ttft_p50_s": b["ttft_s"]["p50"],
              "ttft_ratio": ratio(t["ttft_s"]["p50"], b["ttft_s"]["p50"])}
             for t in report.get("turns", []) if (b := theirs.get(t["turn"]))]
    gap = lambda r: (r.get("inter_token_s") or {}).get("p50")  # noqa: E731
    return {"tokens_per_s_ratio": ratio(report["tokens_per_s"], base.get("tokens_per_s")),
            "inter_token_p50_ratio": ratio(gap(report), gap(base)), "turns": turns}


def main(argv=None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    if args.compare_to:
        with open(args.compare_to) as f:
            report["compared_to"] = {"file": args.compare_to, **compare(report, json.load(f))}
    lat = report["latency_s"]
    fmt = lambda x: "n/a" if x is None else f"{x * 1e3:.1f} ms"  # noqa: E731
    print(f"{report['succeeded']}/{report['requests']} requests in {report['elapsed_s']:.2f} s: "
          f"{report['requests_per_s']:.2f} req/s, {report['tokens_per_s']:.1f} generated tok/s")
    print(f"latency p50 {fmt(lat['p50'])}, p90 {fmt(lat['p90'])}, p99 {fmt(lat['p99'])}")
    if args.stream:
        t, g = report["ttft_s"], report["inter_token_s"]
        print(f"time to first token p50 {fmt(t['p50'])}, p90 {fmt(t['p90'])}, p99 {fmt(t['p99'])}")
        print(f"inter-token gap p50 {fmt(g['p50'])}, p99 {fmt(g['p99'])}")
    for t in report.get("turns", []):
        print(f"turn {t['turn']}: {t['requests']} requests, prompt {t['prompt_tokens_mean']:.0f} tokens, "
              f"time to first token p50 {fmt(t['ttft_s']['p50'])}, latency p50 {fmt(t['latency_s']['p50'])}")
    if report.get("prefix_cache"):
        pc = report["prefix_cache"]
        print(f"prefix cache: {pc.get('hits_total', 0):.0f} hits of {pc.get('lookups_total', 0):.0f} lookups, "
              f"{pc.get('hit_tokens_total', 0):.0f} prompt tokens not prefilled "
              f"({pc.get('token_hit_rate', 0):.1%}), {pc.get('evictions_total', 0):.0f} evictions")
    sc = report.get("server_counters", {})
    if sc.get("qmtp_prefill_passes_total"):  # how the server batched the prompts it prefilled
        passes = sc["qmtp_prefill_passes_total"]
        print(f"server: {sc.get('qmtp_prefills_total', 0):.0f} prompts prefilled in {passes:.0f} passes "
              f"({sc.get('qmtp_prefill_pass_rows_total', 0) / passes:.2f} rows a pass), "
              f"{sc.get('qmtp_loop_calls_total', 0):.0f} decode calls")
    if "long_prompt" in report:
        lp, d = report["long_prompt"], report.get("inter_token_s_during_long_prefill")
        print(f"long prompt of {lp['prompt_tokens']} tokens: time to first token {fmt(lp['ttft_s'])}"
              + (f"; the other streams' gaps meanwhile: {d['count']}, p50 {fmt(d['p50'])}, p99 {fmt(d['p99'])}, "
                 f"max {fmt(d['max'])}" if d else ""))
    if "compared_to" in report:
        c = report["compared_to"]
        rate = c["tokens_per_s_ratio"]
        print(f"against {c['file']}: generated tok/s x{rate:.3f}" if rate is not None else
              f"against {c['file']}: no generated tok/s to compare")
        if c["inter_token_p50_ratio"] is not None:
            print(f"  inter-token gap p50 x{c['inter_token_p50_ratio']:.3f}")
        for t in c["turns"]:
            print(f"  turn {t['turn']}: time to first token p50 {fmt(t['ttft_p50_s'])} vs {fmt(t['base_ttft_p50_s'])}"
                  + (f" ({t['ttft_ratio']:.1%})" if t["ttft_ratio"] is not None else ""))
    if report["errors"]:
        print(f"errors by status: {report['errors']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
