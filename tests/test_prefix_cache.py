"""The prefix cache in the serving engine: conversations that share system prompts and grow turn by turn,
with random cancellations and a budget and page pool small enough to evict, give token for token the
output of the same engine without the cache (K = 0 and 3; TP2 on two CPU devices); afterwards every
page is free or held by the cache alone and the cache's byte count is what it holds. Also: a resumed
prefill serves sampled and logprobs requests as a full one, the warm-up covers its programs, metrics
report it, and bad settings are refused by name.

The tiny checkpoint's `model` (float32, page size 8) from tests/conftest.py; blocks of 16 tokens.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import qmtp
from qmtp.serve import metrics, slots, warmup
from qmtp.serve.engine import Engine
from qmtp.serve.engine_config import AUTO_PREFIX_STATE_BYTES, EngineConfig
from serving_fixtures import logged_device_calls

BLOCK, SLOTS, MAX_LEN = 16, 3, 160
pytestmark = pytest.mark.usefixtures("single_threaded_cpu_blas")


def config(k, cache_bytes, num_pages=80, **kw) -> EngineConfig:
    """3 slots of up to 160 tokens (21 pages each with K=3) in a pool of 80 pages: the cache's pages
    compete with the requests' own."""
    return EngineConfig(batch_slots=SLOTS, mtp_k=k, rounds_per_call=2, max_model_len=MAX_LEN, num_pages=num_pages,
                        prefix_cache_bytes=cache_bytes, prefix_block=BLOCK, **kw)


def conversations(seed: int, n_conv: int, turns: int):
    """Per conversation: its system prompt (one of two: 32 tokens, so that prompts part right at a block
    boundary, where the MTP entry before it must be rewritten; and 20-50) and its user turns (3-20 tokens)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 380, int(n)).tolist() for n in (2 * BLOCK, rng.integers(20, 50))]
    return [(systems[rng.integers(2)], [rng.integers(0, 380, int(n)).tolist() for n in rng.integers(3, 20, turns)])
            for _ in range(n_conv)]


def run_workload(model, k: int, seed: int, n_conv: int, turns: int, max_tokens: int = 6, cancel: float = 0.15):
    """Round r submits every conversation's turn r to an engine without the cache, then to one with it
    (one engine busy at a time: two threads compiling one TP program at once crash XLA on the CPU); the
    history grows with the cache-off response (a prompt that outgrows max_model_len is not sent). Returns
    the requests sent, those compared (not cancelled), the cached engine."""
    rng = np.random.default_rng(seed + 1)
    off = Engine(model, config(k, 0)).start()
    # a checkpoint of the tiny model: 39.5 KB of GDN state and hidden, 12 KB per page; room for a few
    on = Engine(model, config(k, 1_000_000)).start()
    histories = [list(system) for system, _ in conversations(seed, n_conv, turns)]
    users = [u for _, u in conversations(seed, n_conv, turns)]
    sent = compared = 0
    on.end_hits = 0  # requests resumed from a finished response's end (off a block boundary)
    for turn in range(turns):
        prompts = [h + users[c][turn] for c, h in enumerate(histories)]
        fits = [len(p) + max_tokens < MAX_LEN for p in prompts]
        want = [off.submit(p, max_tokens) for p, ok in zip(prompts, fits) if ok]
        want = [w.result(300) for w in want]
        got = [on.submit(p, max_tokens) for p, ok in zip(prompts, fits) if ok]
        sent += len(got)
        cancelled = [h for h in got if rng.random() < cancel]
        time.sleep(rng.random() * 0.05)
        for h in cancelled:
            h.cancel()
        for w, handle in zip(want, got):
            g = handle.result(300)
            on.end_hits += handle.prefix_hit_tokens % BLOCK != 0
            if g.finish_reason != "cancelled":
                assert g.tokens == w.tokens, (turn, w.tokens, g.tokens)
                compared += 1
        for c, p in enumerate(prompts):
            if fits[c]:
                histories[c] = p + want.pop(0).tokens
    assert off.stop(10) and on.stop(10)
    return sent, compared, on


def assert_only_the_cache_holds_pages(engine: Engine) -> None:
    cache, alloc = engine.prefix, engine.allocator
    held = sorted({p for ckpt in cache._entries.values() for p in ckpt.pages})
    assert alloc.free_pages == alloc.num_pages - len(held)
    assert all(alloc.refs(p) == sum(p in ckpt.pages for ckpt in cache._entries.values()) for p in held)
    assert cache.bytes == sum(c.state_bytes for c in cache._entries.values()) + len(held) * cache.page_bytes
    assert cache.bytes <= cache.budget_bytes and not engine._active


@pytest.mark.slow  # CI time: each way a request resumes is tested alone below
@pytest.mark.parametrize("k", [0, 3])
def test_conversations_with_the_cache_equal_those_without(model, k):
    sent, compared, on = run_workload(model, k, seed=k, n_conv=6, turns=4)
    assert sent == 24 and compared >= 15
    assert on.counters["prefill_pass_rows"] > on.counters["prefill_passes"]  # some passes held several prompts
    assert on.prefix.hits >= 6 and on.end_hits >= 3 and on.prefix.evicted > 0, (on.prefix.hits, on.end_hits,
                                                                                 on.prefix.evicted)
    assert_only_the_cache_holds_pages(on)


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 3])
def test_two_hundred_requests_with_the_cache_equal_those_without(model, k):
    sent, compared, on = run_workload(model, k, seed=10 + k, n_conv=40, turns=6)
    assert sent >= 200 and compared >= 0.75 * sent and on.prefix.evicted > 0
    assert_only_the_cache_holds_pages(on)


@pytest.mark.slow  # 33 s; TP2 generation and the cache at TP1 are in the default suite
def test_tp2_with_the_cache_equals_without(ckpt):
    tp2 = qmtp.load(ckpt, dtype="float32", page_size=8, progress=False, tp=2)
    _, compared, on = run_workload(tp2, 3, seed=5, n_conv=4, turns=3)
    assert compared >= 8 and on.prefix.hits > 0
    assert_only_the_cache_holds_pages(on)


def _prefilled_state(engine: Engine, prompts, which: int = -1) -> dict:
    """Prefills the prompts one after the other on the test's thread (max_tokens 2: each stays in its
    slot) and returns, for prompts[which], per position < its length: the target and MTP KV entries, its
    GDN rows, and its first draft and MTP hidden."""
    handles = []
    for prompt in prompts:
        handles.append(engine.submit(prompt, 2))
        engine._admit()
        while engine.passes.pending:
            engine.passes.run_one()
    slot = next(s for s, a in engine._active.items() if a.handle is handles[which])
    state, slots, n = engine._device.state, engine._device.slots, len(prompts[which])
    pages = engine.allocator.pages(engine._active[slot].reservation)
    at = [(pages[t // engine.page_size], t % engine.page_size) for t in range(n)]
    entries = lambda pools: [np.stack([np.asarray(x)[p, o] for p, o in at]) for x in pools]  # noqa: E731
    read = int(slots.gdn_slot[slot])
    return {"kv": entries(state.kv.k + state.kv.v), "mtp_kv": entries(state.mtp_kv.k + state.mtp_kv.v),
            "gdn": [np.asarray(x[read, slot]) for x in state.conv + state.ssm],
            "d1": int(slots.d1[slot]), "mh": np.asarray(slots.mh[slot]), "first": int(slots.pending[slot])}


def assert_same_state(got: dict, want: dict) -> None:
    assert (got["first"], got["d1"]) == (want["first"], want["d1"])
    for name in ("kv", "mtp_kv", "gdn", "mh"):  # the passes differ (from the boundary on): float32 rounding
        for g, w in zip(got[name] if name != "mh" else [got[name]], want[name] if name != "mh" else [want[name]]):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_resumed_prefill_leaves_the_state_of_a_full_one(model):
    """The KV of the target and of the MTP layer (its entry at the boundary - 1 rewritten for the new
    prompt's next token), the GDN rows, the first token and draft: as a prefill without the cache; also
    for the first of two prompts resumed from one checkpoint, after the second (pages it shares are
    never written)."""
    system = np.random.default_rng(8).integers(0, 380, 2 * BLOCK).tolist()
    on = Engine(model, config(2, 1 << 24))
    _drive(on, [on.submit(system + [1, 2, 3], 2)])  # prefilled: the cache saw its blocks
    # the first keeps their branch point 32, the second and third resume there; their tokens at 32 differ
    prompts = [system + [7, 7], system + [9, 8, 7, 6, 5], system + [4] * 9]
    got = _prefilled_state(on, prompts, which=1)
    assert on.prefix.hits == 2
    assert_same_state(got, _prefilled_state(Engine(model, config(2, 0)), prompts[1:2]))


def test_a_prompt_that_shares_nothing_is_prefilled_in_one_pass(model):
    """Nothing to resume from and no branch point: a prompt shorter than a piece keeps no checkpoint (it
    would end a pass there: a short prompt's prefill in two passes costs decoding 28%, 27B, H100) and is
    prefilled in one pass, as without the cache. Sent again, it shares its blocks with the first: it keeps
    its deepest block boundary (their branch point), which a third copy resumes from."""
    prompt = np.random.default_rng(13).integers(0, 380, 3 * BLOCK + 5).tolist()
    on = Engine(model, config(3, 1 << 24))
    _prefilled_state(on, [prompt])
    assert on.counters["prefill_passes"] == 1 and len(on.prefix) == 0
    _prefilled_state(on, [prompt, prompt])
    assert on.counters["prefill_passes"] == 1 + 2 + 1
    assert (on.prefix.hits, on.prefix.hit_tokens) == (1, 3 * BLOCK)


def test_a_resumed_response_end_leaves_the_state_of_a_full_prefill(model):
    """The next turn (prompt, response, new tokens) resumes where the response ended, past its last
    block boundary, with the MTP entry the decode loop wrote for the response's last token."""
    first = np.random.default_rng(12).integers(0, 380, 21).tolist()
    on = Engine(model, config(3, 1 << 24))
    turn = on.submit(first, 6)
    while not turn.finished:
        on._iteration()
    following = first + turn.tokens + [5, 6, 7]
    assert on.prefix.lookup(following)[0] == len(first) + 5  # the response's end, not a block boundary
    other = first + turn.tokens + [9] * 12  # resumed from the same end next: it writes its own pages only
    got = _prefilled_state(on, [following, other], which=0)
    assert_same_state(got, _prefilled_state(Engine(model, config(3, 0)), [following]))


def test_a_response_cut_mid_round_is_kept_at_its_end(tmp_path):
    """Every draft accepted (the controlled checkpoint, K=3): a response's last round is cut by its token
    budget (the prefill's token and two rounds of 4, cut at 6) or by a stop id among the round's tokens.
    The loop commits such a row through its emitted tokens only, so its end is kept, and the next turn
    resumes there and gets qmtp.generate's tokens."""
    from qmtp.tools import make_checkpoint
    path = make_checkpoint.write_checkpoint(str(tmp_path / "ctl"), "tiny_controlled", "fp32", seed=5)
    controlled = qmtp.load(path, dtype="float32", page_size=8, progress=False)
    engine = Engine(controlled, config(3, 1 << 24, stop_token_ids=())).start()
    prompt = np.random.default_rng(14).integers(0, 380, 11).tolist()
    full = engine.generate(prompt, 6, timeout=300).tokens
    following = prompt + full + [5, 6]
    assert engine.prefix.lookup(following)[0] == len(prompt) + 5  # the response's end
    turn = engine.submit(following, 6, stop_token_ids=[])
    assert turn.result(300).tokens == qmtp.generate(controlled, [following], 6, mtp_k=3, stop_token_ids=[]).tokens[0]
    assert turn.prefix_hit_tokens == len(prompt) + 5
    other = np.random.default_rng(15).integers(0, 380, 9).tolist()
    free = qmtp.generate(controlled, [other], 8, mtp_k=3, stop_token_ids=[]).tokens[0]
    assert free[2] not in free[:2]
    cut = engine.generate(other, 8, stop_token_ids=[free[2]], timeout=300)  # the first round's second token
    assert cut.tokens == free[:3] and cut.finish_reason == "stop"
    assert engine.prefix.lookup(other + free[:3] + [7])[0] == len(other) + 2
    assert engine.stop(10)


def test_a_response_a_stop_string_cut_is_not_kept(model):
    """A stop string ends a response on the host, after the round whose tokens the device has already
    committed past the cut: that state does not hold the response the client got, so its end is not
    kept (one the device finished is: the test above)."""
    engine = Engine(model, config(3, 1 << 24)).start()
    prompt = np.random.default_rng(16).integers(0, 380, 9).tolist()  # under a block: no block checkpoint
    free = qmtp.generate(model, [prompt], 14, mtp_k=3).tokens[0]
    text = model.tokenizer.decode(free, skip_special_tokens=True)
    cut = next(i for i in range(3, len(text)) if text[i] != "\ufffd")
    r = engine.generate(prompt, 14, stop=(text[cut:cut + 2],), timeout=300)
    assert r.finish_reason == "stop" and len(r.tokens) < len(free)
    assert len(engine.prefix) == 0 and engine.prefix.lookup(prompt + r.tokens + [7])[0] == 0
    assert engine.stop(10)


def test_requests_finishing_together_are_kept_before_any_finishes(model):
    """Three requests the device finishes in one decode call: the three ends are kept, then the three
    requests finish. A checkpoint between two finishes would delay the later clients, so that the early
    ones' next requests reach an admission alone (more passes of fewer rows)."""
    engine = Engine(model, config(3, 1 << 24, stop_token_ids=()))
    events = []
    take, finish = engine._device.take_gdn_rows, engine._finish
    engine._device.take_gdn_rows = lambda slot: events.append("keep") or take(slot)
    engine._finish = lambda handle, *a, **kw: events.append("finish") or finish(handle, *a, **kw)
    rng = np.random.default_rng(31)
    handles = [engine.submit(rng.integers(0, 380, 12).tolist(), 2) for _ in range(SLOTS)]  # one round each after
    engine._iteration()  # the prefill of all three and the decode call
    assert all(h.finished for h in handles) and len(engine.prefix) == SLOTS
    assert events == ["keep"] * SLOTS + ["finish"] * SLOTS


def test_resumed_requests_sample_and_report_logprobs_as_generate(model):
    """A hit resumes at a boundary; a seeded, logprobs request then gets qmtp.generate's tokens and values,
    and so does a repetition-penalized one, whose penalty counts the cached prefix's ids too."""
    engine = Engine(model, config(2, 1 << 24)).start()
    system = np.random.default_rng(7).integers(0, 380, 40).tolist()
    for tail in ([1, 2, 3], [5, 5]):  # the second keeps their branch point, 32
        engine.generate(system + tail, 4, timeout=300)
    prompt = system + [9, 8, 7, 6]
    got = engine.submit(prompt, 6, temperature=0.9, top_k=40, seed=3, logprobs=3)
    result = got.result(300)
    assert got.prefix_hit_tokens == 32
    want = qmtp.generate(model, [prompt], 6, mtp_k=2, temperature=0.9, top_k=40, seed=3, logprobs=3)
    assert result.tokens == want.tokens[0]
    np.testing.assert_allclose([t.logprob for t in result.logprobs], [t.logprob for t in want.logprobs[0]],
                               rtol=1e-4, atol=1e-5)
    prompt = system + [4, 4, 4]
    penalized = dict(temperature=0.0, repetition_penalty=3.0, logprobs=3)  # the program of the seeded one
    got = engine.submit(prompt, 6, **penalized)
    result = got.result(300)
    assert got.prefix_hit_tokens == 32
    want = qmtp.generate(model, [prompt], 6, mtp_k=2, **penalized).tokens[0]
    assert result.tokens == want != qmtp.generate(model, [prompt], 6, mtp_k=2, logprobs=3).tokens[0]
    text = metrics.render(engine)
    assert "qmtp_prefix_cache_hit_tokens_total 64" in text and "qmtp_prefix_cache_hits_total 2" in text
    assert engine.stop(10)


def test_the_warmup_plan_holds_a_pass_of_each_width_and_a_checkpoint_and_resume(model):
    """The plan alone (nothing compiles): with the cache every prompt goes in passes, so the plan names a pass
    of each width up to the largest bucket asked for, and a checkpoint and resume, instead of prompt buckets."""
    names = [step.name for step in warmup.plan(Engine(model, config(3, 1 << 24)), [16, 64])]
    assert all(f"prefix cache: prefill pass of {w} tokens" in names for w in (16, 32, 64)), names
    assert "prefix cache: checkpoint and resume" in names, names
    assert not any(name.startswith("prompt bucket") for name in names), names
    # batched passes only where their rows pad to at most a piece (prefill_chunk 64: 3 rows x 16)
    chunk64 = dataclasses.replace(model, kernels=dataclasses.replace(model.kernels, prefill_chunk=64))
    names = [step.name for step in warmup.plan(Engine(chunk64, config(3, 1 << 24)), [64])]
    assert [n for n in names if "rows" in n] == ["prefix cache: prefill pass of 16 tokens x 3 rows"], names


@pytest.mark.slow  # CI time: the plan's steps are checked above; test_engine.py's warm-up test runs a plan
def test_the_warmup_covers_passes_checkpoints_and_resumes(model):
    lines = []
    engine = Engine(model, config(3, 1 << 24), log=lines.append)
    engine.warmup([16, 64])
    assert any("prefix cache: checkpoint and resume" in line for line in lines), lines
    assert len(engine.prefix) == 0 and engine.prefix.lookups == 0
    engine.start()
    system = list(range(100, 140))
    first = engine.generate(system + [1, 2], 4, timeout=300)
    for tail in ([3, 4, 5], [6] * 20):  # the first keeps their branch point 32, the second resumes there
        engine.generate(system + tail, 4, timeout=300)
    turn = engine.submit(system + [1, 2] + first.tokens + [7, 8], 4)  # resumed from the first one's end
    turn.result(300)
    assert turn.prefix_hit_tokens == 45 and engine.prefix.hits == 2
    assert engine.counters["serving_compiles"] == 0
    assert engine.stop(10)


def test_prompts_arriving_together_share_passes(model):
    """Prompts admitted together run their passes as the rows of one (programs the warm-up compiled); one
    that shares its first block with a prompt in the pass waits for it and resumes from its checkpoint.
    The warm-up compiles on two threads: its dry pass of checkpoints and resumes leaves nothing behind."""
    engine = Engine(model, config(2, 1 << 24, warmup_threads=2))
    engine.warmup([16, 32])
    rng = np.random.default_rng(16)
    first, second = (rng.integers(0, 380, 20).tolist() for _ in range(2))
    prompts = [first, second, first[:BLOCK] + [7, 7, 7, 7, 7]]
    handles = [engine.submit(p, 4) for p in prompts]
    engine.start()
    want = [qmtp.generate(model, [p], 4, mtp_k=2).tokens[0] for p in prompts]
    assert [h.result(300).tokens for h in handles] == want
    assert [h.prefix_hit_tokens for h in handles] == [0, 0, BLOCK]
    assert engine.counters["prefill_pass_rows"] > engine.counters["prefill_passes"]
    assert engine.counters["serving_compiles"] == 0
    assert engine.stop(10)


def test_prompts_arriving_together_prefill_their_common_system_prompt_once(model):
    """Three prompts of one 40-token system prompt arrive at an empty cache: the first keeps a checkpoint at
    their deepest common block boundary (32; its own deepest is 64), the others wait for it and resume."""
    engine = Engine(model, config(2, 1 << 24))
    rng = np.random.default_rng(21)
    system = rng.integers(0, 380, 40).tolist()
    prompts = [system + rng.integers(0, 380, n).tolist() for n in (30, 5, 7)]
    handles = [engine.submit(p, 4) for p in prompts]
    engine.start()
    want = [qmtp.generate(model, [p], 4, mtp_k=2).tokens[0] for p in prompts]
    assert [h.result(300).tokens for h in handles] == want
    assert [h.prefix_hit_tokens for h in handles] == [0, 2 * BLOCK, 2 * BLOCK]
    assert engine.prefix.hits == 2 and engine.prefix.hit_tokens == 4 * BLOCK
    assert engine.stop(10)


def _drive(engine: Engine, handles) -> None:
    """Runs the scheduling points of an engine not started, on this thread, until the handles finish."""
    while not all(h.finished for h in handles):
        engine._iteration()


def test_a_prompt_waits_only_for_a_deeper_checkpoint_than_its_own(model):
    """After a finished request A (cache: its response's end, 72), a prompt B of A's system prompt, then Q
    (A's prompt and response and 5 more tokens: it resumes at 72) and C (the system prompt and 5 tokens) are
    admitted together: C waits for B's checkpoint at their common block boundary 32 (B's branch point with
    A), Q waits for nothing (B shares less with it than Q resumes from) and joins B's passes."""
    engine = Engine(model, config(2, 1 << 24))  # K=2: the other tests' programs
    rng = np.random.default_rng(22)
    system = rng.integers(0, 380, 40).tolist()
    a = system + rng.integers(0, 380, 30).tolist()
    first = engine.submit(a, 3)
    _drive(engine, [first])
    prompts = [system + rng.integers(0, 380, 30).tolist(), a + first.tokens + rng.integers(0, 380, 5).tolist(),
               system + rng.integers(0, 380, 5).tolist()]
    handles = [engine.submit(p, 3) for p in prompts]
    engine._admit()
    b, q, c = engine.passes.pending.values()
    assert b.awaits is None and q.awaits is None and c.awaits == (b, 2 * BLOCK)
    assert 2 * BLOCK in b.keep
    _drive(engine, handles)
    want = [qmtp.generate(model, [p], 3, mtp_k=2).tokens[0] for p in prompts]
    assert [h.result(0).tokens for h in handles] == want
    assert [h.prefix_hit_tokens for h in handles] == [0, len(a) + 2, 2 * BLOCK]
    assert engine.prefix.hits == 2


def test_serving_resumes_from_either_kind_of_checkpoint_on_the_warm_ups_program(model):
    """A resume at a response's or prompt's end (no hidden) and one at a block (the checkpoint's hidden,
    committed to the device) call resume_prefix alike: after the warm-up, serving adds no entry to its
    jit cache (an uncommitted argument where serving passes a committed one compiled it again, 1 s, H100)."""
    slots.resume_prefix.clear_cache()
    engine = Engine(model, config(2, 1 << 24))
    engine.warmup([16])
    warmed = slots.resume_prefix._cache_size()
    engine.start()
    rng = np.random.default_rng(23)
    first = rng.integers(0, 380, 20).tolist()
    response = engine.submit(first, 3).result(300).tokens
    # a response's end, then a branch point kept (at BLOCK) and a resume there
    for prompt, hit in ((first + response + [5], 22), (first[:BLOCK] + [5, 6], 0), (first[:BLOCK] + [7, 8], BLOCK)):
        assert engine.submit(prompt, 3).result(300).cached_tokens == hit
    assert slots.resume_prefix._cache_size() == warmed == 1
    assert engine.stop(10)


def test_checkpoint_states_stay_within_the_device_memory_the_warm_up_left(model, monkeypatch):
    """Where the device reports its memory, the warm-up bounds the checkpoints' states by what it left
    (less a margin), evicting before a state is taken: here room for two of them, under a budget of 400."""
    lines = []
    engine = Engine(model, config(2, 1 << 24), log=lines.append)
    state = engine._device.gdn_row_bytes() + model.cfg.hidden_size * 4  # a block checkpoint's (f32 hidden)
    headroom = int(2.5 * state / (1 - warmup.PREFIX_STATE_MARGIN))
    monkeypatch.setattr(slots.DeviceBatch, "memory_headroom", lambda self: headroom)
    engine.warmup([16])
    assert engine.prefix.state_limit == int(headroom * (1 - warmup.PREFIX_STATE_MARGIN))
    assert any(line.startswith("prefix cache: its checkpoint states take at most") for line in lines), lines
    engine.start()
    rng = np.random.default_rng(24)
    prompts = [rng.integers(0, 380, 40).tolist() for _ in range(4)]
    for p in prompts:
        assert engine.submit(p, 3).result(300).tokens == qmtp.generate(model, [p], 3, mtp_k=2).tokens[0]
        assert 0 < engine.prefix.state_bytes <= engine.prefix.state_limit
    assert engine.prefix.evicted > 0
    assert engine.stop(10)


def test_auto_sizes_the_cache_by_the_device_memory(model, monkeypatch):
    """--prefix_cache_bytes=auto (the default): the states take at most AUTO_PREFIX_STATE_SHARE of the
    memory free as the engine is built, after the warm-up what it left less the margin (the log says so),
    AUTO_PREFIX_STATE_BYTES where the device reports no memory; the budget is that plus the KV pool."""
    assert EngineConfig().prefix_cache_bytes == "auto"
    cpu = Engine(model, config(2, "auto"))
    pool = cpu.allocator.num_pages * cpu.prefix.page_bytes
    assert cpu.prefix.state_limit == AUTO_PREFIX_STATE_BYTES and cpu.prefix.budget_bytes == pool + (1 << 30)
    headroom = [10**9]
    monkeypatch.setattr(slots.DeviceBatch, "memory_headroom", lambda self: headroom[0])
    lines = []
    engine = Engine(model, config(2, "auto"), log=lines.append)
    assert engine.prefix.state_limit == 5 * 10**8 and engine.prefix.budget_bytes == pool + 5 * 10**8
    headroom[0] = 4 * 10**8
    engine.warmup([16])
    assert engine.prefix.state_limit == 36 * 10**7 and engine.prefix.budget_bytes == pool + 36 * 10**7
    assert "prefix cache: checkpoint states up to 0.36 GB, the device memory the warm-up left (0.40 GB) less 10%, " \
           "and KV pages up to the pool's 80 (--prefix_cache_bytes=auto)" in lines, lines


def test_while_others_decode_a_pass_pads_to_at_most_a_piece(model):
    """With a request decoding, passes take --interleave_piece (16) tokens: two prompts' passes of that
    width do not share a batched pass (3 rows x 16 padded tokens), each runs alone."""
    engine = Engine(model, config(2, 1 << 24, interleave_piece=16, stop_token_ids=())).start()
    rng = np.random.default_rng(25)
    running = engine.submit(rng.integers(0, 380, 10).tolist(), 120)
    while running.first_token_s is None:
        time.sleep(0.01)
    pieces, rows = engine.counters["prefill_passes"], engine.counters["prefill_pass_rows"]
    prompts = [rng.integers(0, 380, 40).tolist() for _ in range(2)]
    handles = [engine.submit(p, 3) for p in prompts]
    got = [h.result(300).tokens for h in handles]
    assert not running.finished  # the passes ran while it decoded
    assert engine.counters["prefill_pass_rows"] - rows == engine.counters["prefill_passes"] - pieces >= 6
    assert got == [qmtp.generate(model, [p], 3, mtp_k=2).tokens[0] for p in prompts]
    running.cancel()
    assert engine.stop(10)


def test_while_others_decode_every_short_prompt_goes_in_at_one_scheduling_point(model):
    """Two prompts of 20-30 tokens arrive while a request decodes, with --interleave_piece 32: each pass takes
    one row (3 rows x 32 padded tokens exceed the piece), yet both go in before the next decode call, as
    the admission without the cache prefills them; a short prompt left for the next scheduling point
    would wait a decode call."""
    engine = Engine(model, config(2, 1 << 24, interleave_piece=32, stop_token_ids=()))
    calls = logged_device_calls(engine)
    rng = np.random.default_rng(27)
    running = engine.submit(rng.integers(0, 380, 10).tolist(), 20)
    engine._iteration()
    prompts = [rng.integers(0, 380, n).tolist() for n in (20, 30)]
    handles = [engine.submit(p, 3) for p in prompts]
    calls.clear()
    engine._iteration()
    assert calls == ["piece", "piece", "run"]
    _drive(engine, handles + [running])
    assert [h.result(0).tokens for h in handles] == [qmtp.generate(model, [p], 3, mtp_k=2).tokens[0] for p in prompts]


def test_a_prompt_waiting_for_a_cancelled_one_prefills_on_its_own(model):
    """A prompt waiting for an earlier one's checkpoint goes on without it when that one is cancelled first:
    its tokens are generate's, and afterwards every page is free or held by the cache alone."""
    engine = Engine(model, config(2, 1 << 24))
    rng = np.random.default_rng(26)
    system = rng.integers(0, 380, 40).tolist()
    first, second = (system + rng.integers(0, 380, n).tolist() for n in (60, 6))
    cancelled, waiting = engine.submit(first, 3), engine.submit(second, 3)
    engine._admit()
    p, q = engine.passes.pending.values()
    assert q.awaits == (p, 2 * BLOCK)
    cancelled.cancel()
    _drive(engine, [cancelled, waiting])
    assert cancelled.result(0).finish_reason == "cancelled"
    assert waiting.result(0).tokens == qmtp.generate(model, [second], 3, mtp_k=2).tokens[0]
    assert waiting.result(0).cached_tokens == 0
    assert_only_the_cache_holds_pages(engine)


def test_choices_of_one_prompt_share_its_prefill(model):
    """Requests submitted together with one prompt (a request's n choices, `Engine.together`: nothing is
    admitted until the last is queued): the first keeps a checkpoint at its end but the last token, the
    others resume there (copying its pages) and prefill that token."""
    engine = Engine(model, config(2, 1 << 24)).start()
    prompt = np.random.default_rng(9).integers(0, 380, 45).tolist()
    with engine.together():
        handles = [engine.submit(prompt, 5)]
        time.sleep(0.3)  # the scheduler, woken by the submit, waits
        assert len(engine._queue) == 1
        handles += [engine.submit(prompt, 5) for _ in range(2)]
    want = qmtp.generate(model, [prompt], 5, mtp_k=2).tokens[0]
    assert [h.result(300).tokens for h in handles] == [want] * 3
    assert [h.prefix_hit_tokens for h in handles] == [0, 44, 44]
    assert engine.prefix.lookups == 3 and engine.prefix.hits == 2
    assert engine.stop(10)


@pytest.mark.parametrize("kw, message", [
    (dict(prefix_block=24), r"--prefix_block=24 must be a power of two, a multiple of --page_size=8"),
    (dict(prefix_block=4), r"--prefix_block=4 must be a power of two, a multiple of --page_size=8")])
def test_bad_settings_are_refused_by_name(model, kw, message):
    with pytest.raises(ValueError, match=message):
        Engine(model, dataclasses.replace(config(0, 1 << 20), **kw))
