"""Long prompts in the serving engine: a prompt longer than the model's prefill_chunk is prefilled one
piece of prefill_chunk tokens per scheduling point, between the decode calls of the running streams,
and gives qmtp.generate's tokens (whose prefill runs the same chunks in one program).

The tiny checkpoint's model with prefill_chunk = 16 and the shapes of tests/serving_fixtures.py
(max_model_len 48): prompts of 17..40 tokens take 2..3 pieces. Scheduling is checked by stepping the
engine's scheduling points on the test's thread (the engine is not started), so the order is exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import qmtp
from qmtp import api
from qmtp.runtime import loop, prefill
from qmtp.serve.engine_config import DEFAULT_INTERLEAVE_PIECE, EngineConfig, interleave_piece
from qmtp.serve.warmup import plan as warmup_plan
from serving_fixtures import assert_all_free, logged_device_calls, make_engine

CHUNK = 16
RNG = np.random.default_rng(11)
LONG = [RNG.integers(0, 380, n).tolist() for n in (17, 40, 32, 33)]
SHORT = RNG.integers(0, 380, 5).tolist()
pytestmark = pytest.mark.usefixtures("single_threaded_cpu_blas")


@pytest.fixture(scope="module")
def chunked(model):
    return dataclasses.replace(model, kernels=dataclasses.replace(model.kernels, prefill_chunk=CHUNK))


def pieces(n: int) -> int:
    return -(-n // CHUNK)


def step_until_done(engine, handles, limit: int = 200) -> None:
    for _ in range(limit):
        if all(h.finished for h in handles):
            return
        engine._iteration()
    raise AssertionError("requests did not finish")


# CI time: the pieces' tokens are checked below at TP2 with K = 2, their order with a running stream at K = 0
@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_long_prompts_in_pieces_give_generate_tokens(chunked, k):
    want = [qmtp.generate(chunked, [p], max_new_tokens=6, mtp_k=k).tokens[0] for p in LONG]
    engine = make_engine(chunked, k)
    handles = [engine.submit(p, 6) for p in LONG]
    got = [h.result(300).tokens for h in handles]
    assert got == want
    assert engine.counters["prefill_passes"] == sum(pieces(len(p)) for p in LONG)
    assert engine.stop(5)
    assert_all_free(engine)


@pytest.mark.parametrize("prompt", [LONG[1], LONG[2]], ids=["ragged_last_piece", "whole_pieces"])
def test_pieces_leave_the_first_draft_of_the_chunked_prefill(chunked, prompt):
    """After the last piece the slot holds the first token, the MTP head's first draft d1 and its hidden
    that prefill.prefill's chunks (qmtp.generate's, its target layer by layer) give for the prompt."""
    engine = make_engine(chunked, 2, start=False)
    handle, slot = engine.submit(prompt, 4), None
    with engine._cv:
        handle = engine._queue.popleft()
    slot = engine.passes.start(handle, engine._free_slots.pop(), engine.allocator.reserve(engine._capacity(handle)))
    while slot in engine.passes.pending:
        engine.passes.run_one()
    got = engine._device.slots
    tokens, n_valid = api._prompt_batch([prompt])
    state = api._new_state(chunked, [len(prompt) + 4 + 3])
    first, want, _ = prefill.prefill(chunked.cfg, chunked.kernels, True, chunked.params, state, tokens, n_valid,
                                  np.array([4], np.int32), np.full((1, 8), loop.NO_STOP, np.int32))
    assert handle.tokens == [int(first[0])]
    assert int(got.pending[slot]) == int(want.pending[0]) and int(got.d1[slot]) == int(want.d1[0])
    # float32, the same sums in another program: f32 rounding only (u = 2^-24, a few hundred sums deep)
    np.testing.assert_allclose(np.asarray(got.mh[slot]), np.asarray(want.mh[0]), rtol=0,
                               atol=1e-5 * float(np.max(np.abs(np.asarray(want.mh[0])))))


@pytest.mark.slow  # CI time: test_while_others_decode_prompts_go_in_interleave_pieces checks piece, run, ... too
def test_a_long_prompt_interleaves_with_running_streams(chunked):
    """One piece per scheduling point, a decode call of the running stream after each: the stream waits
    for one piece at a time, not for the whole prompt; its tokens stay those of generate."""
    engine = make_engine(chunked, 0, start=False)
    calls = logged_device_calls(engine)
    stream = engine.submit(SHORT, 12)
    engine._iteration()  # admits and starts the short prompt, then decodes
    long = engine.submit(LONG[1], 4)
    step_until_done(engine, [stream, long])
    n = pieces(len(LONG[1]))
    first = calls.index("piece")
    assert calls[first:first + 2 * n] == ["piece", "run"] * n, calls
    assert stream.result(1).tokens == qmtp.generate(chunked, [SHORT], max_new_tokens=12).tokens[0]
    assert long.result(1).tokens == qmtp.generate(chunked, [LONG[1]], max_new_tokens=4).tokens[0]
    assert_all_free(engine)


def test_cancelling_a_long_prompt_between_pieces_frees_its_slot_and_pages(chunked):
    engine = make_engine(chunked, 0, start=False)
    long = engine.submit(LONG[1], 4)
    engine._iteration()  # admitted, first piece
    assert engine.passes.pending and engine.counters["prefill_passes"] == 1
    long.cancel()
    engine._iteration()
    assert long.finished and long.result(1).finish_reason == "cancelled" and not engine.passes.pending
    after = engine.submit(LONG[0], 3)  # the slot and pages serve the next long prompt
    step_until_done(engine, [after])
    assert after.result(1).tokens == qmtp.generate(chunked, [LONG[0]], max_new_tokens=3).tokens[0]
    assert_all_free(engine)


def test_warmup_compiles_the_piece_prefill_once_for_every_long_bucket(chunked):
    lines = []
    engine = make_engine(chunked, 0, start=False, log=lines.append)
    engine.warmup()
    assert any(line.startswith("warm-up: ") and f"longer prompts in pieces of {CHUNK} tokens" in line for line in lines)
    assert sum("long prompts: prefill piece of 16 tokens" in line for line in lines) == 1, lines
    assert not any("prompt bucket 32" in line or "prompt bucket 64" in line for line in lines), lines
    engine.start()
    handle = engine.submit(LONG[1], 4)
    handle.result(300)
    assert engine.counters["serving_compiles"] == 0
    assert engine.stop(5)
    assert_all_free(engine)


def piece_widths(engine) -> list[int]:
    """Records the padded width of each prefill pass the engine runs, in order."""
    widths, run = [], engine._device.prefill_piece

    def wrapped(ids, page_rows, offsets, tokens, *rest):
        widths.append(tokens.shape[1])
        return run(ids, page_rows, offsets, tokens, *rest)
    engine._device.prefill_piece = wrapped
    return widths


@pytest.fixture(scope="module")
def chunk32(model):
    return dataclasses.replace(model, kernels=dataclasses.replace(model.kernels, prefill_chunk=32))


def test_while_others_decode_prompts_go_in_interleave_pieces(chunk32):
    """prefill_chunk 32, --interleave_piece 16: a long prompt at an idle engine goes in 32-token pieces;
    while a stream decodes, every prompt longer than 16 tokens goes in 16-token pieces, a decode call
    after each; the tokens stay generate's (chunks of 32)."""
    engine = make_engine(chunk32, 0, start=False, interleave_piece=16)
    steps = [s.name for s in warmup_plan(engine, [64])]
    assert steps[:2] == ["long prompts: prefill piece of 32 tokens",
                         "long prompts: prefill piece of 16 tokens (while others decode)"], steps
    calls, widths = logged_device_calls(engine), piece_widths(engine)
    alone = engine.submit(LONG[1], 4)  # 40 tokens: passes end at 32 and 40
    step_until_done(engine, [alone])
    assert widths == [32, 32] and calls[:3] == ["piece", "piece", "run"], (widths, calls)
    del widths[:], calls[:]
    stream = engine.submit(SHORT, 30)
    engine._iteration()  # admits and starts the short prompt, then decodes
    busy = [engine.submit(LONG[1], 4), engine.submit(LONG[0], 3)]  # 17 tokens: one pass at an idle engine
    step_until_done(engine, busy)
    assert widths == [16] * (3 + 2), widths
    assert all(calls[i + 1] == "run" for i, c in enumerate(calls) if c == "piece"), calls
    step_until_done(engine, [stream])
    assert alone.result(1).tokens == busy[0].result(1).tokens  # the same prompt in other pieces
    assert busy[1].result(1).tokens == qmtp.generate(chunk32, [LONG[0]], max_new_tokens=3).tokens[0]
    assert busy[0].result(1).tokens == qmtp.generate(chunk32, [LONG[1]], max_new_tokens=4).tokens[0]
    assert_all_free(engine)


def test_with_the_prefix_cache_passes_take_at_most_the_interleave_piece_while_others_decode(chunk32):
    """With the prefix cache every prompt goes in passes (a prompt longer than a piece also ending at its
    deepest block boundary): of up to 32 tokens at an idle engine, of up to 16 while a stream decodes."""
    engine = make_engine(chunk32, 0, start=False, interleave_piece=16, prefix_cache_bytes=1 << 20, prefix_block=32)
    widths = piece_widths(engine)
    alone = engine.submit(LONG[1], 4)
    step_until_done(engine, [alone])
    assert widths == [32, 16], widths  # to the block boundary, the rest
    del widths[:]
    stream = engine.submit(SHORT, 30)
    engine._iteration()
    other = LONG[2][:3] + LONG[1][3:]  # shares no block with the first: prefilled from 0
    busy = engine.submit(other, 4)
    step_until_done(engine, [busy, stream])
    assert widths == [16] + [16, 16, 16], widths  # the short prompt's pass, busy's 0-32 in two, the rest
    assert busy.result(1).tokens == qmtp.generate(chunk32, [other], max_new_tokens=4).tokens[0]
    assert alone.result(1).tokens == qmtp.generate(chunk32, [LONG[1]], max_new_tokens=4).tokens[0]
    assert_all_free(engine)


def test_interleave_piece_is_a_bucket_within_the_chunk_and_the_chunk_under_deterministic(chunked):
    for bad in (8, 24, 32):
        with pytest.raises(ValueError, match=f"--interleave_piece={bad} must be a power of two from 16 to "
                                             "--prefill_chunk=16"):
            make_engine(chunked, 0, start=False, interleave_piece=bad)
    assert make_engine(chunked, 0, start=False).interleave_piece == CHUNK  # the default, cut to the chunk
    long_chunk = dataclasses.replace(chunked, kernels=dataclasses.replace(chunked.kernels, prefill_chunk=2048))
    assert interleave_piece(EngineConfig(), long_chunk) == DEFAULT_INTERLEAVE_PIECE == 128
    deterministic = dataclasses.replace(chunked.kernels, impl="pallas", prefill_chunk=32, deterministic=True)
    assert interleave_piece(EngineConfig(), dataclasses.replace(chunked, kernels=deterministic)) == 32
    with pytest.raises(ValueError, match="--interleave_piece=16: under --deterministic"):
        interleave_piece(EngineConfig(interleave_piece=16), dataclasses.replace(chunked, kernels=deterministic))


@pytest.mark.slow  # CI time: the pieces at TP1 above; TP2 prefill and decoding in test_tp_model.py
def test_tp2_pieces_equal_tp1_generate(ckpt, chunked):
    tp2 = qmtp.load(ckpt, dtype="float32", page_size=chunked.page_size, progress=False, tp=2, prefill_chunk=CHUNK)
    engine = make_engine(tp2, 2)
    got = engine.generate(LONG[1], 6, timeout=300).tokens
    assert got == qmtp.generate(chunked, [LONG[1]], max_new_tokens=6, mtp_k=2).tokens[0]
    assert engine.counters["prefill_passes"] == pieces(len(LONG[1]))
    assert engine.stop(5)
    assert_all_free(engine)
