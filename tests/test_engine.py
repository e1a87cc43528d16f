"""The continuous-batching engine (qmtp.serve.engine) without HTTP: tokens equal qmtp.generate (plain and
MTP, TP1 and TP2), stops, page waiting, cancellation, shutdown, repeated prompts through the prefix
cache, batched prefill of waiting prompts, the warm-up of every prompt bucket; nothing leaks.

Compile budget: every engine here has the shapes of tests/serving_fixtures.py (3 slots, page size 8,
max_model_len 48, 12 pages, 2 rounds per call), so the prefill (prompt buckets 16 and 32) and the loop
compile once per K. Prompts are at most 32 tokens; requests make at most 14 tokens. The tiny checkpoint
(`ckpt`), its `model` and `single_threaded_cpu_blas` are fixtures of tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time

import jax
import numpy as np
import pytest

import qmtp
from qmtp.serve import compile_watch
from qmtp.serve.engine import Engine
from qmtp.serve.engine_config import EngineConfig
from qmtp.serve.requests import EngineStopped, QueueFull, RequestError
from qmtp.tools import make_checkpoint
from serving_fixtures import PAGE, SLOTS, assert_all_free, make_engine

RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(0, 380, n).tolist() for n in (3, 9, 17, 30, 5, 12, 24, 1)]
pytestmark = pytest.mark.usefixtures("single_threaded_cpu_blas")


@pytest.fixture(scope="module")
def reference(model):
    """qmtp.generate of each prompt alone (stop ids: the checkpoint's eos), 14 tokens, plain."""
    return [qmtp.generate(model, [p], max_new_tokens=14).tokens[0] for p in PROMPTS]


@pytest.mark.parametrize("k", [0, 2])
def test_tokens_equal_generate(model, reference, k):
    engine = make_engine(model, k)
    handles = [engine.submit(p, 14) for p in PROMPTS]
    results = [h.result(300) for h in handles]
    assert [r.tokens for r in results] == reference
    if k:  # MTP on: the same tokens, and MTP really ran
        assert engine.counters["mtp_drafted"] == 2 * engine.counters["mtp_rounds"] > 0
        alone = qmtp.generate(model, [PROMPTS[2]], max_new_tokens=14, mtp_k=k).tokens[0]
        assert alone == reference[2]
    for r, want in zip(results, reference):
        assert r.finish_reason == ("stop" if want[-1] in model.cfg.eos_token_ids else "length")
        assert r.text == model.tokenizer.decode(want, skip_special_tokens=True)
    assert engine.stop(5)
    assert_all_free(engine)


def test_stop_ids_stop_strings_and_short_max_tokens(model, reference):
    engine = make_engine(model, 2)
    ref = reference[3]
    by_id = engine.submit(PROMPTS[3], 14, stop_token_ids=[ref[4]])
    one = engine.submit(PROMPTS[3], 1)
    full_text = model.tokenizer.decode(ref, skip_special_tokens=True)
    cut = next(i for i in range(3, len(full_text)) if full_text[i] != "\ufffd")
    stop = full_text[cut:cut + 2]
    by_string = engine.submit(PROMPTS[3], 14, stop=(stop, "never-appears"))
    r = by_id.result(60)
    assert r.tokens == ref[:ref.index(ref[4]) + 1] and r.finish_reason == "stop"
    r = one.result(60)
    assert r.tokens == ref[:1] and r.finish_reason == "length"
    r = by_string.result(60)
    assert r.finish_reason == "stop" and r.text == full_text[:full_text.find(stop)]
    assert r.tokens == ref[:len(r.tokens)] and stop not in r.text
    assert engine.stop(5)
    assert_all_free(engine)


def test_limits_and_waiting_for_pages(model, reference):
    engine = make_engine(model, 2, start=False)
    with pytest.raises(RequestError, match=r"prompt \(30 tokens\) \+ max_tokens \(19\) = 49 exceeds the context "
                                           r"limit max_model_len=48 \(--max_model_len\)") as e:
        engine.submit(PROMPTS[3], 19)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="the prompt has 48 tokens; the context limit is max_model_len=48"):
        engine.submit([1] * 48, 1)
    with pytest.raises(RequestError, match=r"outside the vocabulary"):
        engine.submit([1, 10**6], 1)
    with pytest.raises(RequestError, match=r"--max_stop_ids"):
        engine.submit([1], 1, stop_token_ids=list(range(9)))
    small = make_engine(model, 2, start=False, num_pages=4)  # 32 tokens of KV in all
    with pytest.raises(RequestError, match=r"needs 5 KV pages of 8 tokens but the cache has only 4 pages "
                                           r"\(--num_pages\)"):
        small.submit(PROMPTS[3], 5)  # 30 + 5 + K+1 = 38 positions
    # three requests of 5 pages each cannot share 12 pages: the third waits for one to finish
    handles = [engine.submit(PROMPTS[i], 14) for i in (3, 6, 2)]  # 30/24/17 + 14 + 3 -> 6/6/5 pages
    engine.start()
    results = [h.result(120) for h in handles]
    assert [r.tokens for r in results] == [reference[i] for i in (3, 6, 2)]
    assert handles[2].first_token_s >= min(h.finished_s for h in handles[:2])
    assert engine.stop(5)
    assert_all_free(engine)


def test_cancel_queued_and_active_requests(model, reference):
    engine = make_engine(model, 2, start=False)
    queued = engine.submit(PROMPTS[0], 14)
    queued.cancel()
    assert queued.result(1).finish_reason == "cancelled" and queued.tokens == []
    box = {}

    def cancel_after_first(event):  # runs on the engine thread: cancel once tokens flow
        if event.tokens and event.finish_reason is None:
            box["handle"].cancel()

    box["handle"] = engine.submit(PROMPTS[1], 14, listener=cancel_after_first)
    others = [engine.submit(p, 14) for p in PROMPTS[2:6]]
    engine.start()
    active = box["handle"]
    assert active.wait(60) and active.finish_reason == "cancelled"
    assert 1 <= len(active.tokens) < 14 and active.tokens == reference[1][:len(active.tokens)]
    assert [h.result(60).tokens for h in others] == reference[2:6]  # the others are untouched
    assert engine.counters["finished_cancelled"] == 2
    assert engine.stop(5)
    assert_all_free(engine)


def test_shutdown_aborts_queued_and_finishes_active_within_the_timeout(model, reference):
    # a generous timeout: the active requests finish, the queued ones are aborted at once
    engine = make_engine(model, 2, start=False)
    started, proceed = threading.Event(), threading.Event()

    def pause_once(event):  # holds the engine thread at the first token until shutdown began
        started.set()
        proceed.wait(30)

    first = engine.submit(PROMPTS[1], 14, listener=pause_once)  # 9 + 14 + 3 positions: 4 pages
    order = (0, 2, 3, 4, 5, 6)  # 3 and 5 pages: they join `first` in the slots (12 pages); 4 wait
    handles = [engine.submit(PROMPTS[i], 14) for i in order]
    engine.start()
    assert started.wait(60)
    engine.shutdown(timeout=60)
    proceed.set()
    assert engine.stop(timeout=60)
    assert [h.result(1).finish_reason for h in handles[2:]] == ["abort"] * 4
    assert all(not h.tokens for h in handles[2:])
    for h, want in zip([first] + handles[:2], [reference[1], reference[0], reference[2]]):
        assert h.finish_reason in ("stop", "length") and h.tokens == want
    assert_all_free(engine)
    with pytest.raises(EngineStopped):
        engine.submit(PROMPTS[0], 2)
    assert engine.stop(1)  # again: still fine


def test_shutdown_timeout_aborts_active_requests_and_stop_can_be_called_again(model, reference):
    engine = make_engine(model, 2, start=False)
    gate, blocked = threading.Event(), threading.Event()

    def hold(event):  # blocks the engine thread on the first token of this request
        if not gate.is_set():
            blocked.set()
            gate.wait(30)

    held = engine.submit(PROMPTS[1], 14, listener=hold)
    others = [engine.submit(p, 14) for p in PROMPTS[2:4]]
    queued = [engine.submit(p, 14) for p in PROMPTS[4:7]]  # 3 slots: these wait
    engine.start()
    assert blocked.wait(60)
    assert engine.stop(timeout=0.0, wait=0.2) is False  # the thread is stuck in a listener
    assert all(h.result(1).finish_reason == "abort" and not h.tokens for h in queued)
    gate.set()
    assert engine.stop(timeout=0.0, wait=30) is True  # called again: now it is done
    for h in [held] + others:
        assert h.wait(1) and h.finish_reason in ("abort", "stop", "length")
        assert h.tokens == reference[PROMPTS.index(h.prompt_ids)][:len(h.tokens)]
    assert held.finish_reason == "abort" and len(held.tokens) < 14
    assert_all_free(engine)


def test_queue_bound(model):
    engine = make_engine(model, 0, start=False, max_queue=2)
    handles = [engine.submit(PROMPTS[0], 2) for _ in range(2)]
    with pytest.raises(QueueFull, match=r"--max_queue"):
        engine.submit(PROMPTS[0], 2)
    engine.start()
    assert all(h.result(60).finish_reason in ("stop", "length") for h in handles)
    assert engine.stop(5)
    assert engine.counters["rejected_queue_full"] == 1
    assert_all_free(engine)


def test_choices_of_one_prompt_resume_from_the_prefix_cache_until_a_reload(model, ckpt, reference):
    """With the prefix cache a prompt admitted with the same one (as a request's choices) prefills only its
    last token (from the checkpoint the first keeps at its end) and gives the same tokens; reloading the
    model empties the cache: the next one prefills again."""
    engine = make_engine(model, 2, start=False, prefix_cache_bytes=1 << 22, prefix_block=16)
    a = PROMPTS[1]
    handles = [engine.submit(a, 14) for _ in range(2)]
    engine.start()
    results = [h.result(60) for h in handles]
    assert [r.tokens for r in results] == [reference[1]] * 2
    assert [r.cached_tokens for r in results] == [0, len(a) - 1]
    engine.reload(qmtp.load(ckpt, dtype="float32", page_size=PAGE, progress=False), timeout=60)
    assert len(engine.prefix) == 0 and engine.prefix.bytes == 0
    r = engine.generate(a, 14, timeout=60)
    assert r.cached_tokens == 0 and r.tokens == reference[1]
    assert engine.stop(5)
    assert_all_free(engine)


@pytest.mark.slow  # CI time: TP2 == TP1 stays in CI through tests/test_tp_model.py
def test_tp2_engine_equals_tp1_generate(ckpt, model, reference):
    import jax
    assert len(jax.devices()) >= 2, "needs 2 devices (jax_num_cpu_devices=2 in conftest.py)"
    tp2 = qmtp.load(ckpt, dtype="float32", page_size=PAGE, progress=False, tp=2)
    engine = make_engine(tp2, 2, start=False, prefix_cache_bytes=1 << 22, prefix_block=16)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]  # admitted together: the third resumes at the first's end
    handles = [engine.submit(p, 14) for p in prompts]
    engine.start()
    results = [h.result(300) for h in handles]
    assert [r.tokens for r in results] == [reference[0], reference[1], reference[0]]
    assert results[2].cached_tokens == len(PROMPTS[0]) - 1
    assert all(s.shape[0] == 4 and s.ndim == 5 for s in engine._device.state.ssm), "kept in K+2 slots, sharded"
    assert engine.stop(5)
    assert_all_free(engine)


def test_bad_engine_config_names_the_flag(model):
    with pytest.raises(ValueError, match=r"--mtp_k=5: supported 0..4"):
        Engine(model, EngineConfig(mtp_k=5))
    with pytest.raises(ValueError, match=r"--max_model_len=5000 \+ 3 .* exceeds max_position_embeddings=4096"):
        Engine(model, EngineConfig(mtp_k=2, max_model_len=5000))
    with pytest.raises(ValueError, match=r"--batch_slots=0 must be >= 1"):
        Engine(model, EngineConfig(batch_slots=0))
    with pytest.raises(ValueError, match=r"--prefix_cache_bytes=-1: a byte count >= 0 \(0 = off\) or 'auto'"):
        Engine(model, EngineConfig(prefix_cache_bytes=-1))


def test_an_idle_engine_wakes_up_for_a_new_request(model):
    """submit() notifies the idle scheduler: no waiting out its idle poll period (IDLE_WAIT_S)."""
    from qmtp.serve.engine import IDLE_WAIT_S
    engine = make_engine(model, 0)
    engine.generate(PROMPTS[0], 2, timeout=60)  # compiled
    time.sleep(0.1)  # the thread is idle now
    t0 = time.perf_counter()
    assert engine.generate(PROMPTS[0], 2, timeout=60).finish_reason in ("stop", "length")
    assert time.perf_counter() - t0 < 0.5 * IDLE_WAIT_S
    assert engine.stop(5)


def test_scoring_runs_on_the_engine_thread_and_a_shutdown_fails_what_waits(model):
    """Engine.score gives qmtp.score's values; one queued when the engine shuts down fails (no caller waits
    forever), and a stopping engine refuses more."""
    idle = make_engine(model, 0, start=False)  # its thread never runs: the scoring waits
    waiting = idle.score(PROMPTS[1], 2)
    idle.shutdown(1)
    with pytest.raises(EngineStopped):
        waiting.result(5)
    with pytest.raises(EngineStopped):
        idle.score(PROMPTS[1], 2)
    engine = make_engine(model, 0)
    with pytest.raises(RequestError, match="logprobs=21"):
        engine.score(PROMPTS[1], 21)
    assert engine.score(PROMPTS[1], 2).result(300) == qmtp.score(model, [PROMPTS[1]], top_logprobs=2)[0]
    assert engine.stop(10)


def test_text_stream_holds_back_partial_characters_and_stop_strings(model):
    from qmtp.serve.textstream import TextStream
    tok = model.tokenizer
    text = "def fibonacci(n): caf\u00e9 \U0001F642 done"
    ids = tok.encode(text, add_special_tokens=False).ids
    stream, deltas = TextStream(tok), []
    for t in ids:
        deltas.append(stream.push([t]))
        assert "\ufffd" not in deltas[-1]  # never a half character
    deltas.append(stream.finish())
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    stopped = TextStream(tok, ("bonac", "zzz"))
    out = "".join(stopped.push([t]) for t in ids)
    assert stopped.stopped and out == stopped.text == "def fi" and stopped.finish() == ""
    # min_tokens: a stop string that ends within the first min_tokens ids' text does not stop the stream
    ends = next(n for n in range(1, len(ids) + 1) if "bonac" in tok.decode(ids[:n], skip_special_tokens=True))
    held = TextStream(tok, ("bonac",), min_tokens=ends)
    assert "".join(held.push([t]) for t in ids) + held.finish() == text and not held.stopped
    past = TextStream(tok, ("bonac",), min_tokens=ends - 1)  # the stop string ends past those ids' text
    assert "".join(past.push([t]) for t in ids) == "def fi" and past.stopped
    through = TextStream(tok, ("zzz", "bonac", "bo"), include_stop=True)  # the first to begin, then the shortest
    assert "".join(through.push([t]) for t in ids) == "def fibo" and through.stopped
    through = TextStream(tok, ("bonac",), include_stop=True)
    assert "".join(through.push([t]) for t in ids) == through.text == "def fibonac" and through.finish() == ""
    # special tokens: left out by default, kept when asked
    special = [tok.token_to_id("<|im_start|>")] + ids[:4]
    kept = TextStream(tok, skip_special_tokens=False)
    assert "".join(kept.push([t]) for t in special) + kept.finish() == "<|im_start|>def fib"
    plain = TextStream(tok)
    assert "".join(plain.push([t]) for t in special) + plain.finish() == "def fib"


def test_controlled_checkpoint_accepts_every_draft_and_metrics_show_it(tmp_path):
    from qmtp.serve import metrics
    path = make_checkpoint.write_checkpoint(str(tmp_path / "ctl"), "tiny_controlled", "fp32", seed=5)
    controlled = qmtp.load(path, dtype="float32", page_size=PAGE, progress=False)  # same shapes: no new compile
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[5]]
    want = [qmtp.generate(controlled, [p], max_new_tokens=14, stop_token_ids=[]).tokens[0] for p in prompts]
    engine = make_engine(controlled, 2, stop_token_ids=())
    assert [engine.generate(p, 14, timeout=60).tokens for p in prompts] == want
    assert engine.counters["mtp_accepted"] == engine.counters["mtp_drafted"] > 0
    text = metrics.render(engine)
    assert 'qmtp_mtp_position_acceptance{position="1"} 1.0' in text
    assert 'qmtp_mtp_position_acceptance{position="2"} 1.0' in text
    assert "qmtp_mtp_acceptance_rate 1.0" in text and "qmtp_mtp_mean_accepted_length 3.0" in text
    rounds = engine.counters["mtp_rounds"]
    assert f'qmtp_mtp_rounds_by_accepted_total{{accepted="2"}} {rounds}' in text
    assert 'qmtp_mtp_rounds_by_accepted_total{accepted="0"} 0' in text
    assert 'qmtp_requests_total{outcome="length"} 3' in text
    assert engine.stop(5)
    assert_all_free(engine)


def test_a_failing_device_call_fails_every_request_and_releases_everything(model, monkeypatch):
    engine = make_engine(model, 0, start=False)
    assert engine.warmup([3]) > 0  # compiles before start(); leaves nothing behind
    assert_all_free(engine)

    def broken():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "_run_loop", broken)
    handles = [engine.submit(p, 5) for p in PROMPTS[:5]]
    engine.start()
    results = [h.result(60) for h in handles]
    assert all(r.finish_reason == "error" and "device lost" in r.error for r in results)
    assert "device lost" in engine.failed and not engine.running
    with pytest.raises(EngineStopped, match="device lost"):
        engine.submit(PROMPTS[0], 2)
    assert engine.stop(5)
    assert_all_free(engine)


# ---- batched admission: waiting prompts of one bucket share a prefill pass (slots.prefill_into_slots)

@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.slow), 2])  # CI time; K=0 batches above too
def test_waiting_prompts_share_a_prefill_and_give_the_same_tokens(model, reference, k):
    engine = make_engine(model, k, start=False)
    handles = [engine.submit(p, 14) for p in PROMPTS]  # all queued before the first scheduling point
    engine.start()
    assert [h.result(300).tokens for h in handles] == reference
    assert engine.counters["admitted"] == len(PROMPTS)
    assert engine.counters["prefills"] == len(PROMPTS)
    assert engine.counters["prefill_passes"] < len(PROMPTS)  # at least one pass held several prompts
    assert engine.stop(5)
    assert_all_free(engine)


def test_one_prompt_per_pass_when_asked_and_first_token_finishes(model, reference):
    engine = make_engine(model, 0, start=False, prefill_batch=1)
    handles = [engine.submit(p, 14) for p in PROMPTS[:SLOTS]]
    engine.start()
    assert [h.result(300).tokens for h in handles] == reference[:SLOTS]
    assert engine.counters["prefill_passes"] == engine.counters["prefills"] == SLOTS
    assert engine.stop(5)
    batched = make_engine(model, 2, start=False)
    short = [batched.submit(p, 1) for p in PROMPTS[:SLOTS]]  # each ends with its first token
    rest = [batched.submit(p, 14) for p in PROMPTS[SLOTS:]]
    batched.start()
    assert [h.result(300).tokens for h in short] == [r[:1] for r in reference[:SLOTS]]
    assert all(h.result(300).finish_reason == "length" for h in short)
    assert [h.result(300).tokens for h in rest] == reference[SLOTS:]
    assert batched.stop(5)
    assert_all_free(batched)


# ---- warm-up: every prompt bucket compiles before serving; a compile while serving is logged

@contextlib.contextmanager
def backend_compiles():
    """Yields a list that receives (function name, seconds) of every XLA compile (or compile-cache load)
    in the process during the block: JAX's own monitoring event, independent of the engine's log."""
    seen = []

    def listener(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append((kw.get("fun_name"), seconds))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_warmup_compiles_every_prompt_bucket_so_no_request_compiles(model):
    """Prompts of up to 47 tokens: buckets 16, 32 and 64. No other test here sends a bucket-64 prompt, so
    JAX's in-process cache holds no bucket-64 program when this test starts: the first engine, not warmed
    up, compiles one while serving and says so; the second, warmed up, compiles nothing while serving.
    The second compiles on two threads (warmup.precompile), so its serial pass, on this thread, finds
    the bucket-64 batched prefill (compiled by no one before) compiled."""
    lines = []
    cold = make_engine(model, 0, log=lines.append)
    assert cold.prompt_buckets() == [16, 32, 64]
    long = [list(range(2, 2 + n)) for n in (35, 33, 36)]  # bucket 64
    with backend_compiles() as compiles:
        assert len(cold.generate(long[0], 2, timeout=300).tokens) == 2
    assert any("prefill_into_slots" in name for name, _ in compiles), compiles
    assert [line for line in lines if line.startswith("compiled while serving: prompt bucket 64: prefill x 1 row: ")]
    assert cold.counters["serving_compiles"] >= 1
    assert cold.stop(5)

    lines.clear()
    warm = make_engine(model, 0, start=False, log=lines.append, warmup_threads=2)
    with compile_watch.watch() as on_this_thread:
        assert warm.warmup() > 0  # every bucket
    programs = ("jit(prefill_into_slots)", "jit(decode)")
    assert not [name for name, _ in on_this_thread if name in programs], on_this_thread
    assert any(re.fullmatch(r"warm-up: \d+ programs compiled on 2 threads in \d+\.\d s", line) for line in lines)
    steps = [line for line in lines if line.startswith("warm-up [")]
    for bucket in (16, 32, 64):
        for what in ("prefill x 1 row", f"prefill x {SLOTS} rows"):
            assert any(f"] prompt bucket {bucket}: {what}" in line for line in steps), (bucket, what, lines)
    assert any("] decode loop" in line for line in steps)
    assert all(re.search(r": \d+\.\d\d s$", line) for line in steps), steps
    assert re.fullmatch(rf"warm-up done: {len(steps)} programs in \d+\.\d s", lines[-1]), lines
    assert_all_free(warm)
    # 3 slots and 12 pages of 8 tokens, all free again at each scheduling point (2 tokens a request), so
    # the prefill passes are: two bucket-64 prompts together and one of 16; two of 32 and one of 64; one
    # of 32 and two of 16; then PROMPTS[0] again
    order = [long[0], long[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], long[2], PROMPTS[6], PROMPTS[1], PROMPTS[7],
             PROMPTS[0]]
    handles = [warm.submit(p, 2) for p in order]
    lines.clear()
    with backend_compiles() as compiles:
        warm.start()
        results = [h.result(300) for h in handles]
    assert compiles == [] and lines == []
    assert warm.counters["prefill_passes"] == 7 and warm.counters["prefills"] == len(order)
    assert results[-1].tokens == results[2].tokens
    assert warm.stop(5)
    assert_all_free(warm)
