"""The OpenAI-compatible server (qmtp.server) on a loopback port with real clients: the official
openai client (completions, chat, streaming), httpx for raw bodies, the CLI and the load script in
subprocesses. Tokens equal qmtp.generate; errors have OpenAI-style bodies; nothing leaks.

The engines have the shapes of tests/serving_fixtures.py, as in tests/test_engine.py (3 slots, page
size 8, max_model_len 48, 12 pages, 2 rounds per call), so a run of both files compiles each program
once. The tiny checkpoint's `model` and `single_threaded_cpu_blas` are fixtures of tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

import qmtp
from qmtp.serve.chat_template import ChatTemplate
from qmtp.serve.engine import Engine
from qmtp.serve.server import create_app, Server, ServerSettings
from serving_fixtures import MAX_LEN, assert_all_free, make_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny-test"
MAX_TOKENS_LIMIT = 20
RNG = np.random.default_rng(3)
TEXTS = ["def fibonacci(", "The quick brown fox", "class Counter:", "x"]
ID_PROMPTS = [RNG.integers(0, 380, n).tolist() for n in (2, 7, 13, 21, 29)]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
pytestmark = pytest.mark.usefixtures("single_threaded_cpu_blas")


def serve(model, k, max_queue=64, start_engine=True, shutdown_timeout_s=30.0, profile_dir="", reasoning_parser="auto",
          tool_call_parser="auto", api_key="", **engine_kw):
    engine = make_engine(model, k, start=False, max_queue=max_queue, **engine_kw)
    settings = ServerSettings(NAME, max_tokens_limit=MAX_TOKENS_LIMIT, default_max_tokens=4,
                              shutdown_timeout_s=shutdown_timeout_s, profile_dir=profile_dir,
                              reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser, api_key=api_key)
    app = create_app(engine, settings, manage_engine=start_engine)
    server = Server(app, engine, port=0, shutdown_timeout_s=shutdown_timeout_s).start_in_thread()
    return server, f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def mtp_server(model):
    server, url = serve(model, 2, prefix_cache_bytes=200_000, prefix_block=16)
    yield server, url
    assert server.stop(60)


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory) -> pathlib.Path:
    """plain_server's --profile_dir."""
    return tmp_path_factory.mktemp("profile")


@pytest.fixture(scope="module")
def plain_server(model, profile_dir):
    server, url = serve(model, 0, profile_dir=str(profile_dir))
    yield server, url
    assert server.stop(60)


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_idle(engine: Engine, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats()["active"] or engine.stats()["queued"]:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)


def encode(model, text):
    return model.tokenizer.encode(text, add_special_tokens=False).ids


def test_completion_chat_and_streaming_equal_generate_with_mtp_on_and_off(model, mtp_server, plain_server):
    want = qmtp.generate(model, [TEXTS[0]], max_new_tokens=8)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    # the checkpoint's ChatML template, written out (not rendered by the code under test)
    chat_ids = encode(model, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert chat_ids[0] == model.tokenizer.token_to_id("<|im_start|>")  # special tokens parsed
    chat_want = qmtp.generate(model, [chat_ids], max_new_tokens=8)
    texts = {}
    for name, (_, url) in (("mtp", mtp_server), ("plain", plain_server)):
        c = client(url)
        r = c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=8, temperature=0)
        assert r.choices[0].token_ids == want.tokens[0] and r.choices[0].text == want.texts[0]
        assert r.usage.prompt_tokens == len(encode(model, TEXTS[0])) and r.usage.completion_tokens == 8
        assert r.choices[0].finish_reason == "length" and r.model == NAME
        chat = c.chat.completions.create(model=NAME, messages=messages, max_tokens=8)
        assert chat.choices[0].token_ids == chat_want.tokens[0]
        assert chat.choices[0].message.content == chat_want.texts[0] and chat.choices[0].message.role == "assistant"
        chunks = list(c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=8, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.texts[0]
        assert sum((ch.choices[0].token_ids for ch in chunks if ch.choices), []) == want.tokens[0]
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 8
        chat_chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=8, stream=True))
        assert chat_chunks[0].choices[0].delta.role == "assistant"
        texts[name] = "".join(ch.choices[0].delta.content or "" for ch in chat_chunks)
        assert texts[name] == chat_want.texts[0] and chat_chunks[-1].choices[0].finish_reason == "length"
        ids = c.completions.create(model=NAME, prompt=ID_PROMPTS[2], max_tokens=5)  # token-id prompt
        assert ids.choices[0].token_ids == qmtp.generate(model, [ID_PROMPTS[2]], max_new_tokens=5).tokens[0]
        listed = c.models.list()
        assert [m.id for m in listed.data] == [NAME]
    assert texts["mtp"] == texts["plain"]
    # the template's own variables (chat_template_kwargs): here without the assistant turn's header
    bare_ids = encode(model, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    chat = client(mtp_server[1]).chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert chat.choices[0].token_ids == qmtp.generate(model, [bare_ids], max_new_tokens=8).tokens[0]
    assert chat.usage.prompt_tokens == len(bare_ids) < len(chat_ids)
    metrics = httpx.get(mtp_server[1] + "/metrics").text
    assert "qmtp_mtp_draft_tokens_total" in metrics and 'qmtp_mtp_position_acceptance{position="2"}' in metrics
    assert _metric(metrics, "qmtp_mtp_draft_tokens_total") == 2 * _metric(metrics, "qmtp_mtp_rounds_total") > 0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.mark.slow  # ~24 s; concurrent clients stay in the default suite through test_load_script_reports_throughput_and_latency
def test_twenty_clients_times_64_requests_through_three_slots(model, mtp_server):
    server, url = mtp_server
    pool = [(p, p) for p in ID_PROMPTS] + [(t, encode(model, t)) for t in TEXTS]
    full = {i: qmtp.generate(model, [ids], max_new_tokens=6).tokens[0] for i, (_, ids) in enumerate(pool)}
    eos = set(model.cfg.eos_token_ids)

    def expected(i, max_tokens):  # greedy: a shorter request is a prefix of a longer one (cut at a stop id)
        out = []
        for t in full[i][:max_tokens]:
            out.append(t)
            if t in eos:
                break
        return out

    async def one_client(c, seed):
        rng = np.random.default_rng(seed)
        mismatches = []
        for j in range(64):
            i, m = int(rng.integers(len(pool))), int(rng.integers(1, 7))
            if j % 3 == 0:  # a third streams
                stream = await c.completions.create(model=NAME, prompt=pool[i][0], max_tokens=m, stream=True)
                got = [t async for ch in stream for t in (ch.choices[0].token_ids if ch.choices else [])]
            else:
                r = await c.completions.create(model=NAME, prompt=pool[i][0], max_tokens=m)
                got = r.choices[0].token_ids
            if got != expected(i, m):
                mismatches.append((i, m, got))
        return mismatches

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300,
                               http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=40)))
        async with c:
            return await asyncio.gather(*(one_client(c, s) for s in range(20)))

    before = dict(server.engine.counters)
    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    assert results == [[]] * 20
    wait_idle(server.engine)
    counters = server.engine.counters
    assert counters["finished_stop"] + counters["finished_length"] - before.get("finished_stop", 0) - before.get(
        "finished_length", 0) == 20 * 64
    assert_all_free(server.engine, internals=False)
    cache = server.engine.prefix
    assert cache.hits > 0 and cache.bytes <= cache.budget_bytes
    print(f"1280 requests in {elapsed:.1f} s")


@pytest.mark.parametrize("body,status,param,code", [
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    (json.dumps({"model": NAME}).encode(), 400, "prompt", "missing_required_parameter"),
    (json.dumps({"model": NAME, "prompt": 5}).encode(), 400, "prompt", "invalid_type"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens", "invalid_type"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "model", "model_not_found"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": MAX_TOKENS_LIMIT + 1}).encode(), 400, "max_tokens",
     "max_tokens_exceeded"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens", "invalid_value"),
    (json.dumps({"model": NAME, "prompt": list(range(40)), "max_tokens": 10}).encode(), 400, "max_tokens",
     "context_length_exceeded"),
    (json.dumps({"model": NAME, "prompt": list(range(48)), "max_tokens": 1}).encode(), 400, "prompt",
     "context_length_exceeded"),
    (json.dumps({"model": NAME, "prompt": "x", "temperature": -0.5}).encode(), 400, "temperature",
     "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "temperature": 1, "top_p": 1.5}).encode(), 400, "top_p",
     "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "presence_penalty": 2.5}).encode(), 400, "presence_penalty",
     "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "logit_bias": {"99999": 1}}).encode(), 400, "logit_bias",
     "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "logit_bias": {"a": 1}}).encode(), 400, "logit_bias",
     "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "n": 0}).encode(), 400, "n", "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "n": 65}).encode(), 400, "n", "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "logprobs": 21}).encode(), 400, "logprobs", "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "logprobs": True}).encode(), 400, "logprobs", "invalid_type"),
    (json.dumps({"model": NAME, "prompt": "x", "best_of": 2}).encode(), 400, "best_of", "unsupported_value"),
    (json.dumps({"model": NAME, "prompt": ["a", ""]}).encode(), 400, "prompt", "invalid_value"),
    (json.dumps({"model": NAME, "prompt": ["a"] * 33, "n": 2}).encode(), 400, "prompt", "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "response_format": {"type": "json_object"}}).encode(), 400,
     "response_format", "unsupported_value"),
    (json.dumps({"model": NAME, "prompt": "x", "repetition_penalty": 0}).encode(), 400, "repetition_penalty",
     "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": 3, "min_tokens": 4}).encode(), 400, "min_tokens",
     "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "min_tokens": -1}).encode(), 400, "min_tokens", "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "allowed_token_ids": []}).encode(), 400, "allowed_token_ids",
     "invalid_value"),
    (json.dumps({"model": NAME, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop",
     "invalid_value"),
    (json.dumps({"model": NAME, "prompt": [1, 99999]}).encode(), 400, "prompt", "invalid_value"),
])
def test_bad_requests_get_openai_error_bodies(mtp_server, body, status, param, code):
    server, url = mtp_server
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code and err["message"], err
    assert err["type"] == "invalid_request_error"
    assert_all_free(server.engine, internals=False)


def test_bad_requests_through_the_openai_client(mtp_server):
    c = client(mtp_server[1])
    with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist") as e:
        c.completions.create(model="nope", prompt="x")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError, match=r"min_p=2.0 must be in \[0, 1\]"):
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=1.0,
                                  extra_body={"min_p": 2.0})
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs cannot set messages") as e:
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                  extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.param == "chat_template_kwargs"
    # the tiny checkpoint's ChatML template writes no tool calls: auto chose no tool call parser
    with pytest.raises(openai.BadRequestError, match="tools need a tool call parser") as e:
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], tools=[TOOL])
    assert e.value.param == "tools"
    with pytest.raises(openai.BadRequestError, match=r"context limit (is )?max_model_len=48"):
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello " * 30}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"exceeds the server limit of 20 \(--max_tokens_limit\)"):
        c.completions.create(model=NAME, prompt="x", max_tokens=21)
    r = httpx.get(mtp_server[1] + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_chat_parsers_on_keep_a_reply_without_tags_as_its_content(model):
    """With the reasoning and tool-call parsers forced on (auto leaves them off for the tiny checkpoint),
    the tiny model's reply, which holds no tags, is all content, whole or streamed; a request with tools
    is served (its template ignores them). tests/test_chat_output.py covers replies with tags."""
    server, url = serve(model, 0, reasoning_parser="qwen3", tool_call_parser="hermes")
    try:
        chat_ids = encode(model, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        want = qmtp.generate(model, [chat_ids], max_new_tokens=8)
        c = client(url)
        for tools in (None, [TOOL]):
            kw = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                      **({"tools": tools} if tools else {}))
            r = c.chat.completions.create(**kw)
            message = r.choices[0].message
            assert (message.content or "") == want.texts[0] and message.model_extra["reasoning_content"] is None
            assert r.choices[0].token_ids == want.tokens[0] and r.choices[0].finish_reason == "length"
            assert message.tool_calls is None
            chunks = list(c.chat.completions.create(**kw, stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.texts[0]
            assert chunks[-1].choices[0].finish_reason == "length"
        assert_all_free(server.engine, internals=False)
    finally:
        assert server.stop(60)


def test_tokenize_and_detokenize_give_the_ids_a_request_prefills(model, mtp_server):
    url = mtp_server[1]
    chat_text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = httpx.post(url + "/tokenize", json={"prompt": TEXTS[1]}).json()
    assert r["tokens"] == encode(model, TEXTS[1]) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == encode(model, chat_text)  # the checkpoint's ChatML, written out
    bare = httpx.post(url + "/tokenize", json={"messages": messages,
                                               "chat_template_kwargs": {"add_generation_prompt": False}}).json()
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    text = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text == chat_text  # special tokens kept
    for route, body, param in (("/tokenize", {"text": "x"}, "prompt"), ("/tokenize", {"messages": "x"}, "messages"),
                               ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                               ("/detokenize", {"tokens": "x"}, "tokens")):
        bad = httpx.post(url + route, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (route, body, bad.text)


def test_ignore_eos_and_min_tokens_against_the_default_stop_ids(model):
    """A server whose default stop id is the second token of a prompt's reply: ignore_eos passes it (the
    request's own stop ids still end the reply); min_tokens holds it back, and stop strings too. Also the
    text's options: include_stop_str_in_output (through the stop string), skip_special_tokens false; and
    allowed_token_ids."""
    prompt, full = next((p, out) for p in TEXTS  # one whose first token has text of its own
                        for out in qmtp.generate(model, [encode(model, p)], max_new_tokens=6, stop_token_ids=[]).tokens
                        if model.tokenizer.decode(out[:1]).strip() and "\ufffd" not in model.tokenizer.decode(out[:1]))
    until = lambda t: full[:full.index(t) + 1]  # noqa: E731  (the reply cut at t's first occurrence)
    server, url = serve(model, 2, stop_token_ids=(full[1],))
    try:
        c = client(url)

        def create(**kw):
            return c.completions.create(model=NAME, prompt=prompt, max_tokens=6, **kw).choices[0]

        assert create().token_ids == until(full[1])
        passed = create(extra_body={"ignore_eos": True})
        assert passed.token_ids == full and passed.finish_reason == "length"
        own = create(extra_body={"ignore_eos": True, "stop_token_ids": [full[2]]})
        assert own.token_ids == until(full[2]) and own.finish_reason == "stop"
        want = qmtp.generate(model, [encode(model, prompt)], max_new_tokens=6, stop_token_ids=[full[1]],
                             min_tokens=4).tokens[0]
        assert len(want) > 4 and create(extra_body={"min_tokens": 4}).token_ids == want
        first_text = model.tokenizer.decode(full[:1])
        cut = create(stop=[first_text], extra_body={"ignore_eos": True})
        assert cut.text == "" and cut.finish_reason == "stop"
        kept = create(stop=[first_text], extra_body={"ignore_eos": True, "min_tokens": 6})
        assert kept.token_ids == full and kept.finish_reason == "length"
        through = create(stop=[first_text], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
        assert through.text == first_text and through.finish_reason == "stop"
        special = model.tokenizer.token_to_id("<|im_end|>")  # forced by a logit bias
        forced = dict(logit_bias={str(special): 100}, extra_body={"ignore_eos": True})
        assert create(**forced).text == "" and create(**forced).token_ids == [special] * 6
        forced["extra_body"]["skip_special_tokens"] = False
        assert create(**forced).text == "<|im_end|>" * 6
        allowed = [full[3], special]  # vLLM's allowed_token_ids: the reply draws on these only
        assert set(create(extra_body={"ignore_eos": True, "allowed_token_ids": allowed}).token_ids) <= set(allowed)
    finally:
        assert server.stop(60)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_sampling_parameters_are_honoured(model, mtp_server, route):
    """temperature, top_k, top_p, min_p and seed reach the engine: a seeded request repeats its tokens, which
    are qmtp.generate's with that seed; with n = 3, choice i is the request seeded seed + i."""
    server, url = mtp_server
    body = {"model": NAME, "max_tokens": 6, **({"prompt": "x"} if route == "/v1/completions" else
                                               {"messages": [{"role": "user", "content": "x"}]}),
            "temperature": 1.2, "top_k": 50, "top_p": 0.9, "min_p": 0.01, "seed": 42}
    ids = [httpx.post(url + route, json=body, timeout=120).json()["choices"][0]["token_ids"] for _ in range(2)]
    assert ids[0] == ids[1]
    if route == "/v1/completions":
        want = qmtp.generate(model, ["x"], max_new_tokens=6, mtp_k=2, temperature=1.2, top_k=50,
                             top_p=0.9, min_p=0.01, seed=42).tokens[0]
        assert ids[0] == want
    r = httpx.post(url + route, json={**body, "n": 3}, timeout=120).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for i, c in enumerate(r["choices"]):
        alone = httpx.post(url + route, json={**body, "seed": 42 + i}, timeout=120).json()["choices"][0]
        assert c["token_ids"] == alone["token_ids"], i
    assert r["choices"][0]["token_ids"] == ids[0] and r["choices"][1]["token_ids"] != ids[0]
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])
    assert_all_free(server.engine, internals=False)


def _lp_reference(model, text, n_tokens, top):
    """qmtp.generate's tokens and logprobs (greedy, K = 2) for a text prompt."""
    result = qmtp.generate(model, [text], max_new_tokens=n_tokens, mtp_k=2, logprobs=top)
    return result.tokens[0], result.logprobs[0]


def test_several_prompts_get_n_choices_each_in_prompt_order(model, mtp_server):
    """A completion of two prompts with n = 2: choices 0, 1 are the first prompt's, 2, 3 the second's, each
    qmtp.generate's tokens for its prompt (whole and streamed); usage counts each prompt once (streamed with
    continuous_usage_stats: in every chunk, the tokens sent so far)."""
    c = client(mtp_server[1])
    want = [qmtp.generate(model, [text], max_new_tokens=8).tokens[0] for text in TEXTS[:2]]
    r = c.completions.create(model=NAME, prompt=TEXTS[:2], max_tokens=8, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.token_ids for ch in r.choices] == [want[0], want[0], want[1], want[1]]
    assert r.usage.prompt_tokens == sum(len(encode(model, text)) for text in TEXTS[:2])
    assert r.usage.completion_tokens == 4 * 8
    got, usage = {i: [] for i in range(4)}, []
    for chunk in c.completions.create(model=NAME, prompt=TEXTS[:2], max_tokens=8, n=2, stream=True,
                                      stream_options={"include_usage": True, "continuous_usage_stats": True}):
        for ch in chunk.choices:
            got[ch.index] += ch.model_extra["token_ids"]
        usage.append(chunk.usage.completion_tokens)  # vLLM's continuous_usage_stats: in every chunk, so far
        assert usage[-1] == sum(map(len, got.values()))
    assert list(got.values()) == [want[0], want[0], want[1], want[1]] and usage[-1] == 4 * 8


def test_echo_returns_the_prompt_and_its_scores_before_the_choice(model, mtp_server):
    """echo: the text begins with the prompt's; logprobs list the prompt's tokens first (the first with null
    values, the others qmtp.score's), then the choice's (qmtp.generate's), with one run of text offsets;
    streamed, the same. max_tokens 0 with echo: the prompt alone (a loglikelihood evaluation's request). And
    vLLM's prompt_logprobs (completions: per choice; chat: at the top level; not streamed)."""
    c = client(mtp_server[1])
    ids = encode(model, TEXTS[0])
    tokens, want = _lp_reference(model, TEXTS[0], 6, 3)
    scored = qmtp.score(model, [ids], top_logprobs=3)[0]
    text_of = lambda t: model.tokenizer.decode([t])  # noqa: E731
    r = c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=6, logprobs=3, echo=True).choices[0]
    assert r.text == TEXTS[0] + model.tokenizer.decode(tokens) and r.model_extra["token_ids"] == tokens
    lp = r.logprobs
    assert lp.tokens == [text_of(t) for t in ids + tokens]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], [s.logprob for s in scored] + [w.logprob for w in want],
                               rtol=1e-5, atol=1e-5)
    assert lp.top_logprobs[1] == pytest.approx({**{text_of(i): v for i, v in scored[0].top}, lp.tokens[1]:
                                                scored[0].logprob})
    assert lp.text_offset == np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]).tolist()
    chunks = list(c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=6, logprobs=3, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.text
    assert sum((ch.choices[0].logprobs.text_offset for ch in chunks if ch.choices[0].logprobs), []) == lp.text_offset
    alone = c.completions.create(model=NAME, prompt=[ids], max_tokens=0, logprobs=1, echo=True)
    assert alone.choices[0].text == TEXTS[0] and alone.choices[0].model_extra["token_ids"] == []
    assert alone.choices[0].finish_reason == "length" and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.tokens == lp.tokens[:len(ids)]
    np.testing.assert_allclose(alone.choices[0].logprobs.token_logprobs[1:], lp.token_logprobs[1:len(ids)])
    bad = httpx.post(mtp_server[1] + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    # vLLM's prompt_logprobs: per prompt token its {id: {logprob, rank, decoded_token}}, alternatives too
    got = c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=2, extra_body={"prompt_logprobs": 3})
    listed = got.choices[0].model_extra["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(ids)
    for entry, s in zip(listed[1:], scored):
        assert entry[str(s.token)] == pytest.approx({"logprob": s.logprob, "rank": s.rank,
                                                     "decoded_token": text_of(s.token)})
        assert [entry[str(i)]["rank"] for i, _ in s.top] == [1, 2, 3]
    chat = httpx.post(mtp_server[1] + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    streamed = httpx.post(mtp_server[1] + "/v1/completions", json={"model": NAME, "prompt": "x", "stream": True,
                                                                 "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_an_api_key_guards_every_route_but_health_and_metrics(model):
    server, url = serve(model, 0, api_key="sesame")
    try:
        for headers in ({}, {"Authorization": "Bearer open"}, {"Authorization": "sesame"}):
            for method, route in (("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/tokenize")):
                r = getattr(httpx, method)(url + route, headers=headers, **({"json": {}} if method == "post" else {}))
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, route)
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0, timeout=120)
        assert [m.id for m in keyed.models.list().data] == [NAME]
    finally:
        assert server.stop(60)


def test_continue_final_message_ends_the_prompt_inside_the_final_message(model, mtp_server):
    """vLLM's continue_final_message: the prompt (as /tokenize gives it) ends with the final message's text, its
    end-of-turn not written; add_generation_prompt at the top level is the template's variable."""
    url = mtp_server[1]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"

    def tokens(**kw):
        return httpx.post(url + "/tokenize", json={"model": NAME, **kw})

    begun = chat + [{"role": "assistant", "content": "The answer"}]
    got = tokens(messages=begun, continue_final_message=True).json()["tokens"]
    assert got == encode(model, head + "<|im_start|>assistant\nThe answer")
    assert tokens(messages=chat, add_generation_prompt=False).json()["tokens"] == encode(model, head)
    both = tokens(messages=begun, continue_final_message=True, add_generation_prompt=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    empty = tokens(messages=chat + [{"role": "assistant", "content": ""}], continue_final_message=True)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(model, mtp_server):
    """vLLM's truncate_prompt_tokens: k keeps the last k tokens (the reply is that prompt's); -1 keeps as many
    as the context leaves beside max_tokens, so a prompt longer than the context is served."""
    c = client(mtp_server[1])
    ids = ID_PROMPTS[2] * 3
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=4, extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].model_extra["token_ids"] == qmtp.generate(model, [ids[-5:]], max_new_tokens=4).tokens[0]
    long = (ids * MAX_LEN)[:MAX_LEN + 3]
    r = c.completions.create(model=NAME, prompt=long, max_tokens=4, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == MAX_LEN - 4 and len(r.choices[0].model_extra["token_ids"]) == 4
    bad = httpx.post(mtp_server[1] + "/v1/completions",
                     json={"model": NAME, "prompt": "x", "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_logprobs_in_both_routes_streamed_or_not(model, mtp_server):
    """The OpenAI shapes of qmtp.generate's logprobs: completions (tokens, token_logprobs, top_logprobs with
    the chosen token, text_offset) and chat (content entries with bytes and top_logprobs), whole and
    streamed, for each of n = 2 choices."""
    server, url = mtp_server
    c = client(url)
    tokens, want = _lp_reference(model, TEXTS[0], 6, 3)
    text_of = lambda t: model.tokenizer.decode([t])  # noqa: E731
    for stream in (False, True):
        got = {0: [], 1: []}
        reply = c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=6, logprobs=3, n=2, stream=stream)
        for chunk in (reply if stream else [reply]):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    lp = choice.logprobs
                    got[choice.index] += list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset))
        for i in (0, 1):
            assert [g[0] for g in got[i]] == [text_of(t) for t in tokens], (stream, i)
            np.testing.assert_allclose([g[1] for g in got[i]], [w.logprob for w in want], rtol=1e-5, atol=1e-6)
            for g, w in zip(got[i], want):
                assert g[2] == pytest.approx({**{text_of(t): v for t, v in w.top}, text_of(w.token): w.logprob})
            assert [g[3] for g in got[i]] == np.cumsum([0] + [len(text_of(t)) for t in tokens[:-1]]).tolist()
    messages = [{"role": "user", "content": TEXTS[1]}]
    tokens, want = _lp_reference(model, ChatTemplate.from_checkpoint(model.checkpoint_dir).render(messages), 5, 2)
    reply = c.chat.completions.create(model=NAME, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].model_extra["token_ids"] == tokens
    assert [e.token for e in content] == [text_of(t) for t in tokens]
    np.testing.assert_allclose([e.logprob for e in content], [w.logprob for w in want], rtol=1e-5, atol=1e-6)
    for e, w in zip(content, want):
        assert e.bytes == list(e.token.encode())
        want_top = [(text_of(i), list(text_of(i).encode())) for i, _ in w.top]
        assert [(t.token, t.bytes) for t in e.top_logprobs] == want_top
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], [v for _, v in w.top], rtol=1e-5, atol=1e-6)
    streamed = c.chat.completions.create(model=NAME, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2,
                                         stream=True)
    entries = [e for chunk in streamed for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content]
    # the same prompt again: the prefix cache keeps its branch point and prefills it in two passes (float32
    # rounding: the logprobs agree to the reference's tolerance, not bit for bit)
    assert [e.token for e in entries] == [e.token for e in content]
    np.testing.assert_allclose([e.logprob for e in entries], [e.logprob for e in content], rtol=1e-5, atol=1e-6)
    plain = c.chat.completions.create(model=NAME, messages=messages, max_tokens=5)
    assert plain.choices[0].logprobs is None
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": messages, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    assert_all_free(server.engine, internals=False)


def test_client_disconnect_mid_stream_cancels_the_request(model, mtp_server, monkeypatch):
    server, url = mtp_server
    engine = server.engine
    slow = engine._run_loop

    def slow_loop():  # +100 ms per device call (2 tokens): the request is far from done when the client leaves
        time.sleep(0.1)
        slow()

    monkeypatch.setattr(engine, "_run_loop", slow_loop)
    wait_idle(engine)
    cancelled = engine.counters["finished_cancelled"]
    body = {"model": NAME, "prompt": ID_PROMPTS[0], "max_tokens": MAX_TOKENS_LIMIT, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["token_ids"]
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while engine.counters["finished_cancelled"] == cancelled:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.01)
    wait_idle(engine)
    assert_all_free(engine, internals=False)
    # a client that gives up on a non-streamed request cancels it too (noticed within DISCONNECT_POLL_S)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=dict(body, stream=False), timeout=0.3)
    deadline = time.monotonic() + 10
    while engine.counters["finished_cancelled"] == cancelled + 1:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.01)
    wait_idle(engine)
    assert_all_free(engine, internals=False)


def test_full_queue_gets_429_and_a_stopped_engine_503(model):
    server, url = serve(model, 0, max_queue=2, start_engine=False)
    engine = server.engine
    try:
        assert httpx.get(url + "/health").status_code == 503  # engine not running yet
        results = []

        def post():
            results.append(httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": [1, 2], "max_tokens": 2},
                                      timeout=60))

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while engine.stats()["queued"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        full = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": [1, 2], "max_tokens": 2})
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client(url).completions.create(model=NAME, prompt=[1, 2], max_tokens=2)
        engine.start()
        for t in threads:
            t.join(60)
        assert [r.status_code for r in results] == [200, 200]
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert engine.stop(10)
        late = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": [1, 2], "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert httpx.get(url + "/health").status_code == 503
        metrics = httpx.get(url + "/metrics").text
        assert _metric(metrics, 'qmtp_requests_rejected_total{reason="queue_full"}') == 2
        assert_all_free(engine, internals=False)
    finally:
        assert server.stop(30)


def test_health_and_requests_answer_503_until_the_warmup_ends(model):
    """The server listens while the engine thread warms up (server.main: engine.start(warmup_buckets)
    before uvicorn runs); the warm-up's last program, the decode loop, is held here until the test has
    seen /health and a request refused."""
    lines, hold = [], threading.Event()
    engine = make_engine(model, 0, start=False, log=lines.append)
    loop_call = engine._run_loop
    engine._run_loop = lambda: (hold.wait(60), loop_call())[1]
    engine.start(warmup_buckets=[16])
    server = Server(create_app(engine, ServerSettings(NAME, max_tokens_limit=MAX_TOKENS_LIMIT)), engine,
                    port=0).start_in_thread()
    url = f"http://127.0.0.1:{server.port}"
    try:
        body = {"model": NAME, "prompt": [1, 2], "max_tokens": 2}
        deadline = time.monotonic() + 120
        while (health := httpx.get(url + "/health")).json().get("programs_done") != 2:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.05)
        # bucket 16: prefill x 1 row and x 3 rows are done; the loop is held (its sampled forms come last)
        assert health.status_code == 503 and health.json() == {"status": "warming up", "programs_done": 2,
                                                               "programs": 5}
        early = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert early.status_code == 503 and early.json()["error"]["code"] == "warming_up", early.text
        assert "warming up" in early.json()["error"]["message"]
        hold.set()
        while (health := httpx.get(url + "/health")).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.05)
        assert health.json() == {"status": "ok"}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert lines[0] == "warm-up: 5 programs to compile (prompt buckets 16; the decode loop)"
        assert [line.split(":")[0] for line in lines[1:6]] == [
            "warm-up [1/5] prompt bucket 16", "warm-up [2/5] prompt bucket 16", "warm-up [3/5] decode loop (2 steps "
            "per call)", "warm-up [4/5] decode loop with sampling (2 steps per call)",
            "warm-up [5/5] decode loop with logprobs (2 steps per call)"]
        assert lines[6].startswith("warm-up done: 5 programs in ")
        assert_all_free(engine, internals=False)
    finally:
        hold.set()
        assert server.stop(30)


def test_shutdown_with_active_and_queued_requests(model):
    server, url = serve(model, 2, shutdown_timeout_s=0.5)
    engine = server.engine
    slow = engine._run_loop
    engine._run_loop = lambda: (time.sleep(0.2), slow())  # streams stay active past the timeout
    outcomes = {}

    def stream(i):
        c = client(url)
        try:
            for _ in c.completions.create(model=NAME, prompt=ID_PROMPTS[i % 2], max_tokens=MAX_TOKENS_LIMIT,
                                          stream=True):
                pass
            outcomes[i] = "finished"
        except openai.APIError as e:
            outcomes[i] = ("error", getattr(e, "code", None) or (e.body or {}).get("code"))

    def complete(i):
        r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": ID_PROMPTS[0], "max_tokens": 4},
                       timeout=60)
        outcomes[i] = (r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=complete, args=(i,)) for i in range(3, 5)]
    for t in threads[:3]:
        t.start()
    deadline = time.monotonic() + 60
    while engine.stats()["active"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for t in threads[3:]:
        t.start()
    while engine.stats()["queued"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    assert server.stop(30)  # what SIGINT / SIGTERM do
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 15
    assert [outcomes[i] for i in range(3)] == [("error", "shutting_down")] * 3  # streams: aborted at the timeout
    assert [outcomes[i] for i in (3, 4)] == [(503, "shutting_down")] * 2  # queued: aborted at once
    assert engine.counters["finished_abort"] == 5
    assert not engine.running and engine.stop(1)
    assert_all_free(engine, internals=False)


def test_prefix_cache_hits_are_exact_and_reported(model, mtp_server):
    server, url = mtp_server
    c = client(url)
    prompt = [11, 29, 7, 301, 42, 5, 88]
    metrics = httpx.get(url + "/metrics").text
    hits0, lookups0 = (_metric(metrics, f"qmtp_prefix_cache_{m}_total") for m in ("hits", "lookups"))
    cold = c.completions.create(model=NAME, prompt=prompt, max_tokens=6)
    turn = prompt + cold.choices[0].token_ids + [17, 3]  # the next turn: resumed at the response's end
    warm = c.completions.create(model=NAME, prompt=turn, max_tokens=6)
    assert cold.choices[0].token_ids == qmtp.generate(model, [prompt], max_new_tokens=6).tokens[0]
    assert warm.choices[0].token_ids == qmtp.generate(model, [turn], max_new_tokens=6).tokens[0]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (cold, warm)]
    assert cached == [0, len(turn) - 3]
    metrics = httpx.get(url + "/metrics").text
    assert _metric(metrics, "qmtp_prefix_cache_hits_total") == hits0 + 1
    assert _metric(metrics, "qmtp_prefix_cache_lookups_total") == lookups0 + 2
    assert _metric(metrics, "qmtp_prefix_cache_bytes") <= _metric(metrics, "qmtp_prefix_cache_budget_bytes") == 200_000


def test_load_script_reports_throughput_and_latency(mtp_server, tmp_path):
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, "scripts/load_test.py", f"--url={mtp_server[1]}", "--requests=24",
                        "--concurrency=4", "--prompt_tokens=2,20", "--max_tokens=4", "--stream",
                        "--long_prompt_tokens=30", "--long_prompt_after_s=0.1", f"--output_json={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["succeeded"] == 24 and report["errors"] == {}
    gaps, long = report["inter_token_s"], report["long_prompt"]
    assert 0 < gaps["p50"] <= gaps["p99"]
    assert long["ok"] and long["prompt_tokens"] == 30 and long["generated_tokens"] == 4 and 0 < long["ttft_s"] <= long["latency_s"]
    during = report["inter_token_s_during_long_prefill"]
    assert (during["count"] == 0) == (during["max"] is None)
    assert during["count"] == 0 or during["p50"] <= during["p99"] <= during["max"]
    assert "inter-token gap p50" in r.stdout and "long prompt of 30 tokens: time to first token" in r.stdout
    assert report["requests_per_s"] > 0 and report["tokens_per_s"] > 0 and report["generated_tokens"] > 0
    assert 0 < report["latency_s"]["p50"] <= report["latency_s"]["p90"] <= report["latency_s"]["p99"]
    assert "req/s" in r.stdout and "p99" in r.stdout
    counters = report["server_counters"]  # what the load added on the server: 24 requests and the long one
    assert counters["qmtp_prefills_total"] == 25 and counters["qmtp_loop_calls_total"] > 0
    passes = counters["qmtp_prefill_passes_total"]
    assert 0 < passes <= 25 and f"server: 25 prompts prefilled in {passes:.0f} passes" in r.stdout
    assert counters["qmtp_generation_tokens_total"] == report["generated_tokens"] + long["generated_tokens"]
    again = subprocess.run([sys.executable, "scripts/load_test.py", f"--url={mtp_server[1]}", "--requests=3",
                            "--concurrency=3", "--prompt_tokens=2,20", "--max_tokens=4", f"--output_json={out}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and json.loads(out.read_text())["server_counters"]["qmtp_prefills_total"] == 3
    h = subprocess.run([sys.executable, "scripts/load_test.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert h.returncode == 0 and "--concurrency" in h.stdout and "p50/p90/p99" in h.stdout


def test_profile_endpoints_write_a_trace_of_the_load_script(mtp_server, plain_server, profile_dir):
    """Without --profile_dir both endpoints refuse, naming the flag; with it, start / stop around the load
    script's requests (--profile) write a trace there, and a second start or a stop without one is refused."""
    for action in ("start", "stop"):
        r = httpx.post(f"{mtp_server[1]}/{action}_profile")
        assert r.status_code == 400 and "--profile_dir" in r.json()["error"]["message"]
    server, url = plain_server
    r = httpx.post(url + "/stop_profile")
    assert r.status_code == 400 and "no profile is running" in r.json()["error"]["message"]
    run = subprocess.run([sys.executable, "scripts/load_test.py", f"--url={url}", "--requests=2", "--concurrency=2",
                          "--prompt_tokens=2,8", "--max_tokens=2", "--profile"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"profile written to {profile_dir}" in run.stdout
    assert list(profile_dir.rglob("*.xplane.pb")) and list(profile_dir.rglob("perfetto_trace.json.gz"))
    assert httpx.post(url + "/start_profile").status_code == 200
    r = httpx.post(url + "/start_profile")
    assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
    assert httpx.post(url + "/stop_profile").status_code == 200


def test_load_script_holds_conversations_and_reports_turns_and_the_prefix_cache(model, tmp_path):
    server, url = serve(model, 2, prefix_cache_bytes=1 << 22, prefix_block=8)
    try:
        out, base = tmp_path / "chat.json", tmp_path / "base.json"  # base: an earlier run's report, in part
        base.write_text(json.dumps({"tokens_per_s": 1.0, "turns": [{"turn": 1, "ttft_s": {"p50": 1.0}}]}))
        r = subprocess.run([sys.executable, "scripts/load_test.py", f"--url={url}", "--requests=13", "--concurrency=2",
                            "--turns=3", "--system_tokens=16", "--prompt_tokens=2,5", "--max_tokens=3", "--stream",
                            "--vocab=380", f"--output_json={out}", f"--compare_to={base}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads(out.read_text())
        turns = report["turns"]
        # 13 requests hold 4 whole conversations: the 13th would start one it cannot finish
        assert [(t["turn"], t["requests"]) for t in turns] == [(0, 4), (1, 4), (2, 4)]
        assert turns[0]["prompt_tokens_mean"] < turns[1]["prompt_tokens_mean"] < turns[2]["prompt_tokens_mean"]
        assert report["prefix_cache"]["hits_total"] >= 4 and report["prefix_cache"]["hit_tokens_total"] > 0
        assert "turn 2: 4 requests" in r.stdout and "prefix cache: " in r.stdout
        compared = report["compared_to"]
        assert compared["tokens_per_s_ratio"] == report["tokens_per_s"]
        assert [t["turn"] for t in compared["turns"]] == [1], compared  # the turns both runs have
        assert f"against {base}: generated tok/s x" in r.stdout and "vs 1000.0 ms (" in r.stdout, r.stdout
    finally:
        assert server.stop(60)


def test_load_script_compares_each_turn_and_the_throughput_with_an_earlier_run():
    spec = importlib.util.spec_from_file_location("load_test", os.path.join(ROOT, "scripts", "load_test.py"))
    load_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_test)
    turn = lambda t, p50: {"turn": t, "ttft_s": {"p50": p50}}  # noqa: E731
    now = {"tokens_per_s": 99.0, "inter_token_s": {"p50": 0.05}, "turns": [turn(0, 1.0), turn(1, 0.1), turn(2, None)]}
    before = {"tokens_per_s": 100.0, "inter_token_s": {"p50": 0.04}, "turns": [turn(1, 0.8), turn(2, 0.9)]}
    c = load_test.compare(now, before)
    assert c["tokens_per_s_ratio"] == 0.99 and c["inter_token_p50_ratio"] == 1.25
    assert load_test.compare({"tokens_per_s": 1.0}, before)["inter_token_p50_ratio"] is None  # not streamed
    assert [(t["turn"], t["ttft_ratio"]) for t in c["turns"]] == [(1, 0.125), (2, None)]


def test_load_script_waits_for_health_before_sending():
    """Against a server that is not (yet) ready, the load test waits for /health, then says so; it
    sends nothing that a warming-up server would refuse."""
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    r = subprocess.run([sys.executable, "scripts/load_test.py", f"--url={url}", "--wait_ready_s=2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "/health did not answer 200 within --wait_ready_s=2" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc, port: int, timeout_s: float) -> list[str]:
    """Polls /health of a server process until it answers 200 (the process must stay alive); returns the
    statuses of the 503 answers before that."""
    deadline, statuses = time.monotonic() + timeout_s, []
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            if r.status_code == 200:
                return statuses
            statuses.append(r.json()["status"])
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)


BUILD_SCRIPT = """
import sys
from absl import flags
from qmtp.serve import server_cli
server_cli.define_flags()
for checkpoint in sys.argv[1:]:
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["server", "--checkpoint=" + checkpoint, "--dtype=float32", "--compile_cache=off"])
    engine = server_cli.build(["server"])[1]
    print("mtp_k", engine.config.mtp_k, "prefix cache states", engine.prefix.state_limit, flush=True)
"""


def test_by_default_the_draft_length_is_auto_and_the_prefix_cache_on(tmp_path):
    """Without --mtp_k the server chooses K per round, on a checkpoint with an MTP layer; one without any
    (its config and tensors stripped of it) is served plainly, and the log says why. Without
    --prefix_cache_bytes the prefix cache is on, sized automatically."""
    import safetensors.numpy
    from qmtp.tools import make_checkpoint
    path = make_checkpoint.write_checkpoint(str(tmp_path / "no_mtp"), "tiny", "fp32", seed=1)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["text_config"]["mtp_num_hidden_layers"] = 0
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    weights = os.path.join(path, "model.safetensors")
    tensors = safetensors.numpy.load_file(weights)
    safetensors.numpy.save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, weights)
    env = dict(os.environ, JAX_PLATFORMS="cpu", QMTP_CACHE=str(tmp_path), PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, "preset:tiny", path], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # the prefix cache is on, its states within AUTO_PREFIX_STATE_BYTES where the device reports no memory
    assert r.stdout.split("\n")[:2] == [f"mtp_k {k} prefix cache states {1 << 30}" for k in ("auto", "0")], r.stdout
    assert f"{path}: no MTP layer (mtp_num_hidden_layers=0): plain decoding" in r.stderr
    assert ("chat replies: reasoning parser none (auto: the tokenizer has no <think> and </think> tokens), tool call "
            "parser none (auto: the chat template writes no tool calls)") in r.stderr


def test_cli_serves_the_flagfile_and_exits_cleanly_on_sigterm(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", QMTP_CACHE=str(tmp_path), PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1")
    h = subprocess.run([sys.executable, "-m", "qmtp.server", "--help"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert h.returncode == 0
    for flag in ("checkpoint", "mtp_k", "batch_slots", "rounds_per_call", "max_model_len", "max_tokens_limit",
                 "max_queue", "prefix_cache_bytes", "prefix_block", "host", "port", "tp",
                 "shutdown_timeout_s", "warmup_buckets", "warmup_threads", "num_layers", "reasoning_parser",
                 "tool_call_parser", "api_key"):
        assert f"--{flag}" in h.stdout, flag
    bad = subprocess.run([sys.executable, "-m", "qmtp.server", "--checkpoint=/nonexistent"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: /nonexistent")
    sliced = subprocess.run([sys.executable, "-m", "qmtp.server", f"--checkpoint={tmp_path}", "--num_layers=2"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert sliced.returncode == 2 and "--num_layers slices synthetic presets only" in sliced.stderr
    port = _free_port()
    # the warm-up compiles every prompt bucket (16 and 32 for prompts of up to 23 tokens) before /health
    # says ok; then prompts of new lengths compile nothing ("compiled while serving" would say so). The
    # prefix cache is on by default: no block (64 tokens) fits in --max_model_len=24, but a response
    # still keeps its end, whose checkpoint and resume the warm-up compiled too. One prompt per pass (CI
    # time: tests/test_prefix_cache.py warms up and serves batched passes)
    proc = subprocess.Popen([sys.executable, "-m", "qmtp.server", "--flagfile=configs/server_tiny.flags",
                             f"--port={port}", "--max_model_len=24", "--prefill_batch=1", "--mtp_k=1",
                             "--log_level=warning"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert "warming up" in _wait_healthy(proc, port, 240)
        c = client(f"http://127.0.0.1:{port}")
        r = c.completions.create(model="tiny", prompt="def fibonacci(", max_tokens=3)
        assert len(r.choices[0].token_ids) == 3
        first = list(range(3, 9))
        r = c.completions.create(model="tiny", prompt=first, max_tokens=3)
        turn = first + r.choices[0].token_ids + [9]  # the next turn: from the prefix cache, at the response's end
        r = c.completions.create(model="tiny", prompt=turn, max_tokens=3)
        assert r.usage.prompt_tokens_details.cached_tokens == len(turn) - 2
        r = c.completions.create(model="tiny", prompt=list(range(1, 21)), max_tokens=2)  # bucket 32
        assert len(r.choices[0].token_ids) == 2
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert _metric(metrics, "qmtp_prefix_cache_hits_total") == 1
        assert _metric(metrics, "qmtp_compiles_while_serving_total") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        out = proc.stdout.read()
        steps = [line for line in out.splitlines() if line.startswith("warm-up [")]
        assert [line.split("] ")[1].rsplit(":", 1)[0] for line in steps if "prefix cache" in line] == [
            "prefix cache: prefill pass of 16 tokens", "prefix cache: prefill pass of 32 tokens",
            "prefix cache: checkpoint and resume"], out
        assert re.search(rf"^warm-up done: {len(steps)} programs in \d+\.\d s", out, re.M), out
        assert "serving" in out and "compiled while serving" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_chat_template_default_and_errors(tmp_path):
    from qmtp.serve.chat_template import ChatTemplate, ChatTemplateError, DEFAULT_TEMPLATE
    bare = ChatTemplate.from_checkpoint(str(tmp_path))  # no tokenizer_config.json: the ChatML default
    assert bare.source == DEFAULT_TEMPLATE
    assert bare.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "</s>"},
        "chat_template": "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                         "[{{ m.role }}] {{ m.content | tojson }}{{ eos_token }}{% endfor %}"}))
    custom = ChatTemplate.from_checkpoint(str(tmp_path))
    assert custom.render([{"role": "user", "content": "a\"b"}]) == '[user] "a\\"b"</s>'
    with pytest.raises(ChatTemplateError, match="no tools"):
        custom.render([{"role": "tool", "content": "x"}])
    # chat_template.jinja wins over the config's field (as in transformers); a request's variables reach it
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}{% if enable_thinking is defined and not "
                                                  "enable_thinking %} /no_think{% endif %}{{ eos_token }}")
    sidecar = ChatTemplate.from_checkpoint(str(tmp_path))
    assert sidecar.origin == str(tmp_path / "chat_template.jinja")
    assert sidecar.render([{"role": "user", "content": "q"}]) == "q</s>"
    assert sidecar.render([{"role": "user", "content": "q"}], {"enable_thinking": False}) == "q /no_think</s>"
    with pytest.raises(ChatTemplateError, match="chat_template_kwargs cannot set messages, tools"):
        sidecar.render([{"role": "user", "content": "q"}], {"tools": [], "messages": []})


def test_options_at_their_neutral_values_are_accepted():
    """Clients that send every option at its default (LangChain, the openai client's extras) are served."""
    from qmtp.serve import protocol
    body = {"model": NAME, "prompt": "x", "response_format": {"type": "text"}, "repetition_penalty": 1.0,
            "min_tokens": 0, "ignore_eos": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    assert protocol.parse_completion(body, NAME, MAX_TOKENS_LIMIT, 4, {}).prompts == ["x"]


def test_sampling_defaults_come_from_generation_config_where_it_samples(tmp_path):
    from qmtp.serve import protocol, sampling_defaults
    assert sampling_defaults.from_checkpoint(str(tmp_path)) == {}  # no generation_config.json
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert sampling_defaults.from_checkpoint(str(tmp_path)) == {}
    gen.write_text(json.dumps({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.05}))
    assert sampling_defaults.from_checkpoint(str(tmp_path)) == {"repetition_penalty": 1.05}  # greedy's too
    gen.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 1,
                               "repetition_penalty": 1.1}))
    defaults = sampling_defaults.from_checkpoint(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    assert sampling_defaults.describe(defaults).startswith(
        "sampling defaults from generation_config.json: temperature 0.6, top_p 0.95, top_k 20, repetition_penalty 1.1")
    limits = (NAME, MAX_TOKENS_LIMIT, 4, defaults)
    left_out = protocol.parse_completion({"model": NAME, "prompt": "x"}, *limits)
    no_penalties = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "min_tokens": 0,
                    "allowed_token_ids": None}
    assert left_out.sampling == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "seed": None,
                                 "repetition_penalty": 1.1, **no_penalties}
    own, _, _ = protocol.parse_chat({"model": NAME, "messages": [{"role": "user", "content": "x"}], "temperature": 0,
                                     "top_k": 0, "min_p": 0.1, "seed": 3, "presence_penalty": 1.5,
                                     "repetition_penalty": 1, "logit_bias": {"7": -100}}, *limits)
    assert own.sampling == {"temperature": 0, "top_k": 0, "top_p": 0.95, "min_p": 0.1, "seed": 3,
                            "repetition_penalty": 1, **no_penalties, "presence_penalty": 1.5, "logit_bias": {7: -100.0}}
    gen.write_text(json.dumps({"do_sample": True, "top_p": 1.5}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p=1.5 must be in \(0, 1\]"):
        sampling_defaults.from_checkpoint(str(tmp_path))


def test_the_shipped_model_serves_with_mtp_by_default(tmp_path):
    """`python -m qmtp.server --checkpoint=models/qmtp-demo --mtp_k=3` starts with the default context
    limit: min(4096, max_position_embeddings - (K+1)) = 4092 for the demo's 4096 positions."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", QMTP_CACHE=str(tmp_path), PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qmtp.server", "--checkpoint=models/qmtp-demo", "--mtp_k=3",
                             f"--port={port}", "--nowarmup", "--log_level=warning"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # the startup lines, until the one that says it serves (or the exit)
            lines.append(line)
            if line.startswith("serving"):
                break
        assert lines and lines[-1].startswith("serving") and "max_model_len=4092" in lines[-1], "".join(lines)
        assert "sampling: greedy unless a request sets temperature\n" in lines  # its do_sample is false
        _wait_healthy(proc, port, 60)  # SIGTERM is a clean stop once uvicorn listens
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
