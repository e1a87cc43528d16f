"""Model-level invariants on the f32 Qwen3.5 oracle checkpoint: incremental == one-shot, batched ==
alone, page size and pool layout never change results."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qmtp
from qmtp.model import target as model_lib
from qmtp.runtime.kernel_config import REF
from qmtp.runtime.paging import PageAllocator
from qmtp.runtime.state import init_state, PagedKV
from qmtp.serve import compile_watch
from tolerance import F32_MODEL, assert_close

CKPT = os.path.join(os.path.dirname(__file__), "fixtures", "oracle", "qwen3_5")
RNG = np.random.default_rng(7)
# the target over tokens [B, T] -> (hidden [B, T, E], state), jitted as the loop runs it
forward = jax.jit(model_lib.forward, static_argnames=("cfg", "kernels"))


@pytest.fixture(scope="module")
def tiny():
    return qmtp.load(CKPT, dtype="float32")


def fresh_state(m, capacities, page_size, extra_pages=0, shuffle=False):
    alloc = PageAllocator(sum(-(-c // page_size) for c in capacities) + extra_pages, page_size)
    if shuffle:  # hand out pages in a scrambled order
        alloc._free = list(RNG.permutation(alloc.num_pages))
    table = alloc.page_table([alloc.reserve(c) for c in capacities])
    return init_state(m.cfg, table, alloc.num_pages, page_size, jnp.float32)


def kv_by_position(state, b, n):
    """Contiguous [La, n, Hkv, D] keys of sequence b, read through its page table."""
    s = state.kv.page_size
    table = np.asarray(state.page_table)[b]
    k = np.stack([np.asarray(layer) for layer in state.kv.k])
    return np.stack([k[:, table[p // s], p % s] for p in range(n)], axis=1)


@pytest.mark.parametrize("page_size", [pytest.param(1, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow), 64])  # CI time
def test_prefill_then_decode_equals_longer_prefill(tiny, page_size):
    ids = RNG.integers(0, 250, 23).tolist()
    n = 18  # >= 16: the prefill takes the chunked GDN path, decode the per-token path
    cfg, params = tiny.cfg, tiny.params
    full = fresh_state(tiny, [len(ids)], page_size)
    h_full, full = forward(cfg, params, full, jnp.asarray([ids]), jnp.asarray([len(ids)]), REF)
    part = fresh_state(tiny, [len(ids)], page_size)
    h_part, part = forward(cfg, params, part, jnp.asarray([ids[:n]]), jnp.asarray([n]), REF)
    steps = []
    for t in ids[n:]:
        h, part = forward(cfg, params, part, jnp.asarray([[t]]), jnp.asarray([1]), REF)
        steps.append(h[:, 0])
    h_inc = jnp.concatenate([h_part, jnp.stack(steps, 1)], axis=1)
    logits = lambda h: model_lib.logits_from_hidden(params, h, REF)
    assert_close(logits(h_inc), logits(h_full), F32_MODEL, "logits")
    assert_close(np.stack(part.ssm), np.stack(full.ssm), F32_MODEL, "ssm state")
    assert_close(np.stack(part.conv), np.stack(full.conv), F32_MODEL, "conv state")
    assert_close(kv_by_position(part, 0, len(ids)), kv_by_position(full, 0, len(ids)), F32_MODEL, "kv")
    assert int(part.lengths[0]) == int(full.lengths[0]) == len(ids)


def test_batched_generation_equals_each_alone(tiny):
    prompts = [RNG.integers(0, 250, n).tolist() for n in (3, 40, 17)]
    batched = qmtp.generate(tiny, prompts, max_new_tokens=9, stop_token_ids=[])
    for p, toks in zip(prompts, batched.tokens):
        assert qmtp.generate(tiny, [p], max_new_tokens=9, stop_token_ids=[]).tokens[0] == toks


def test_calls_within_one_bucket_share_their_programs(tiny):
    """Prompt lengths and max_new_tokens within one power-of-two bucket (18 and 27 tokens: 32; 13, 11 and 9
    new tokens: 16): the later calls compile nothing, and a smaller budget gives a prefix of the tokens."""
    a, b = (RNG.integers(0, 250, n).tolist() for n in (18, 27))
    first = qmtp.generate(tiny, [a], max_new_tokens=13, stop_token_ids=[]).tokens[0]
    with compile_watch.watch() as compiles:
        assert len(qmtp.generate(tiny, [b], max_new_tokens=11, stop_token_ids=[]).tokens[0]) == 11
        assert qmtp.generate(tiny, [a], max_new_tokens=9, stop_token_ids=[]).tokens[0] == first[:9]
    assert not [name for name, _ in compiles if name in ("jit(prefill)", "jit(decode)")], compiles


def test_stop_ids_end_each_sequence_independently(tiny):
    prompts = [RNG.integers(0, 250, n).tolist() for n in (6, 11)]
    free = qmtp.generate(tiny, prompts, max_new_tokens=10, stop_token_ids=[])
    stop = free.tokens[0][3]  # the 4th token of sequence 0 becomes a stop id
    stopped = qmtp.generate(tiny, prompts, max_new_tokens=10, stop_token_ids=[stop])
    first_hit = free.tokens[0].index(stop)
    assert stopped.tokens[0] == free.tokens[0][:first_hit + 1]
    cut = free.tokens[1].index(stop) + 1 if stop in free.tokens[1] else 10
    assert stopped.tokens[1] == free.tokens[1][:cut]


def test_page_layout_and_nan_poisoned_pool_do_not_change_logits(tiny):
    ids = RNG.integers(0, 250, 30).tolist()
    cfg, params = tiny.cfg, tiny.params
    base = fresh_state(tiny, [len(ids)], 7)
    h_base, _ = forward(cfg, params, base, jnp.asarray([ids]), jnp.asarray([len(ids)]), REF)
    poisoned = fresh_state(tiny, [len(ids)], 4, extra_pages=5, shuffle=True)
    nan = lambda: tuple(jnp.full(a.shape, jnp.nan, a.dtype) for a in poisoned.kv.k)
    poisoned = dataclasses.replace(poisoned, kv=PagedKV(nan(), nan()))
    h_pois, _ = forward(cfg, params, poisoned, jnp.asarray([ids]), jnp.asarray([len(ids)]), REF)
    assert_close(h_pois, h_base, F32_MODEL, "hidden with NaN pool and shuffled pages")


def test_teacher_forced_logits_equal_generation_argmax(tiny):
    prompt = RNG.integers(0, 250, 9).tolist()
    out = qmtp.generate(tiny, [prompt], max_new_tokens=6, stop_token_ids=[]).tokens[0]
    logits = qmtp.target_logits(tiny, prompt + out)
    assert np.argmax(logits[len(prompt) - 1:-1], axis=-1).tolist() == out
