"""qmtp.model.load.fuse_gate_projections: qmtp.load joins each GDN
layer's in_proj_b and in_proj_a into in_proj_ba = [b | a], per TP shard [b_s | a_s]; the conv kernel
reads its halves in place. The joined model must compute what the unjoined one does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import qmtp
from qmtp import api
from qmtp.model import checkpoint, load, shard_layout
from qmtp.runtime import ops
from qmtp.runtime.kernel_config import PALLAS

PROMPTS = [[3, 14, 15, 92], [65, 35]]


def apart_from(model):
    """`model` with the parameter tree as the checkpoint names it (in_proj_b and in_proj_a apart)."""
    _, params = checkpoint.load(model.checkpoint_dir, dtype=model.dtype, progress=False)
    return dataclasses.replace(model, params=params)


@pytest.fixture(scope="module")
def apart(model):
    return apart_from(model)


def test_load_joins_b_then_a(model, apart):
    for joined, split in zip(model.params["gdn"], apart.params["gdn"], strict=True):
        assert "in_proj_b" not in joined and "in_proj_a" not in joined
        want = np.concatenate([np.asarray(split["in_proj_b"]), np.asarray(split["in_proj_a"])])
        np.testing.assert_array_equal(np.asarray(joined["in_proj_ba"]), want)
    assert isinstance(model.params["gdn"], tuple)
    assert load.fuse_gate_projections(model.params) is model.params  # joined once only


def test_each_tp_shard_holds_its_own_b_then_a(ckpt, apart):
    """Under TP2 shard s holds [b_s | a_s], which is what shard_layout.shard_indices names for the key
    (so the kernel of shard s finds its own heads' b at h and a at Hv_s + h)."""
    tp2 = qmtp.load(ckpt, dtype="float32", progress=False, tp=2)
    cfg = tp2.cfg
    for joined, split in zip(tp2.params["gdn"], apart.params["gdn"], strict=True):
        whole = np.concatenate([np.asarray(split["in_proj_b"]), np.asarray(split["in_proj_a"])])
        shards = sorted(joined["in_proj_ba"].addressable_shards, key=lambda sh: sh.index[0].start)
        assert len(shards) == 2
        for s, shard in enumerate(shards):
            hv_s = split["in_proj_b"].shape[0] // 2
            b_s = np.asarray(split["in_proj_b"])[s * hv_s:(s + 1) * hv_s]
            a_s = np.asarray(split["in_proj_a"])[s * hv_s:(s + 1) * hv_s]
            np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate([b_s, a_s]))
            idx = shard_layout.shard_indices(cfg, "in_proj_ba", whole.shape[0], 2, s)
            np.testing.assert_array_equal(np.asarray(shard.data), whole[idx])


@pytest.mark.slow  # ~14 s; the kernel test's bit-for-bit check of the ba form runs in the default suite
def test_joined_model_computes_what_the_split_one_does(model, apart):
    """Target logits (the reference path: each output row is the same dot product) and greedy tokens,
    plain and MTP K=2."""
    ids = [5, 17, 2, 99, 41, 7]
    np.testing.assert_allclose(api.target_logits(model, ids), api.target_logits(apart, ids), rtol=1e-5, atol=1e-5)
    for k in (0, 2):
        assert (qmtp.generate(model, PROMPTS, max_new_tokens=6, mtp_k=k).tokens
                == qmtp.generate(apart, PROMPTS, max_new_tokens=6, mtp_k=k).tokens)


@pytest.mark.slow
def test_joined_gates_through_the_pallas_conv_kernel(ckpt):
    """impl="pallas" (interpret mode): the conv kernel reading ba's halves in place gives the tokens of
    the split tree, plain and MTP K=3."""
    joined = qmtp.load(ckpt, dtype="float32", progress=False, impl="pallas")
    split = dataclasses.replace(apart_from(joined), kernels=PALLAS)
    assert "in_proj_ba" in joined.params["gdn"][0] and "in_proj_b" in split.params["gdn"][0]
    for k in (0, 3):
        assert (qmtp.generate(joined, PROMPTS, max_new_tokens=6, mtp_k=k).tokens
                == qmtp.generate(split, PROMPTS, max_new_tokens=6, mtp_k=k).tokens)


def test_small_bf16_weights_as_a_reduce():
    """ops.BF16_REDUCE_MAX_OUT: under Pallas a bf16 weight of <= that many output rows at 2..128 token
    rows runs as multiply + f32 sum (no dot in the program); larger weights keep the dot. On the CPU one
    row runs as two (ops.linear), so it takes the reduce form too. Same values within one bf16 rounding."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((96, 320)) / 16, jnp.bfloat16)
    x4 = jnp.asarray(rng.standard_normal((1, 4, 320)), jnp.bfloat16)

    def program(x, weight):
        fn = jax.jit(lambda a, b: ops.linear(a, b, PALLAS))
        return fn.lower(x, weight).as_text(), np.asarray(fn(x, weight), np.float32)

    text, got = program(x4, w)
    assert "dot_general" not in text and "reduce" in text
    want = np.asarray(x4, np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-2)
    wide = jnp.concatenate([w, w, w], axis=0)  # 288 output rows > BF16_REDUCE_MAX_OUT
    assert "dot_general" in program(x4, wide)[0]
    assert "dot_general" not in program(x4[:, :1], w)[0]  # one row: the two-row program on the CPU
