"""The optional FP8 draft head (qmtp.load(..., draft_head="fp8")): MTP drafts go through an FP8
block copy of lm_head, the verify pass through the exact one, so the tokens never change."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qmtp
from qmtp.model import fp8
from qmtp.tools import make_checkpoint


@pytest.mark.parametrize("shape", [(256, 384), (300, 130), (128, 1)])
def test_device_quantizer_matches_the_numpy_quantizer(shape):
    """Scales within 1 ulp of quantize_np's (XLA's f32 division is not numpy's), and every weight
    within one E4M3 rounding of its value: |w - q s| <= max(|w| 2^-4, s 2^-10) (3 mantissa bits;
    subnormal spacing 2^-9 of the scale, half of it for rounding, plus the scale's own ulp)."""
    rng = np.random.default_rng(shape[0])
    w = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0], size=shape)).astype(np.float32)
    w[:128, :min(128, shape[1])] = 0.0  # an all-zero block: scale 1, codes 0
    _, s_np = fp8.quantize_np(w)
    got = jax.jit(fp8.quantize)(jnp.asarray(w))
    s = np.asarray(got.scale)
    assert np.max(np.abs(s.view(np.int32) - s_np.view(np.int32))) <= 1
    assert s[0, 0] == 1.0 and np.all(np.asarray(got.weight[:128, :min(128, shape[1])]).astype(np.float32) == 0)
    full = fp8._expand_np(s, *shape, 128)
    deq = fp8.dequantize_np(np.asarray(got.weight), s)
    bound = np.maximum(np.abs(w) * 2.0**-4, full * 2.0**-10) * (1 + 1e-6)
    assert np.all(np.abs(deq - w) <= bound)


@pytest.fixture(scope="module")
def controlled(tmp_path_factory):
    return make_checkpoint.write_checkpoint(str(tmp_path_factory.mktemp("dh") / "c"), "tiny_controlled", "fp32", seed=2)


PROMPTS = [[3, 14, 15, 92], [65, 35]]


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3])  # CI time
def test_fp8_draft_head_keeps_tokens_and_acceptance(controlled, k):
    plain = qmtp.generate(qmtp.load(controlled, dtype="float32", progress=False), PROMPTS, max_new_tokens=12)
    model = qmtp.load(controlled, dtype="float32", progress=False, draft_head="fp8")
    assert isinstance(model.params["mtp"]["draft_head"], fp8.Fp8Block)
    res = qmtp.generate(model, PROMPTS, max_new_tokens=12, mtp_k=k)
    assert res.tokens == plain.tokens
    assert res.stats["acceptance_rate"] == 1.0  # the controlled margins survive FP8 rounding


def test_the_draft_head_is_what_drafts_use(controlled):
    """A zeroed draft head makes every draft id 0: acceptance collapses, tokens stay plain greedy's;
    teacher-forced MTP logits go through it too."""
    model = qmtp.load(controlled, dtype="float32", progress=False, draft_head="fp8")
    head = model.params["mtp"]["draft_head"]
    zero = fp8.Fp8Block(jnp.zeros_like(head.weight), head.scale)
    broken = dataclasses.replace(model, params=dict(model.params, mtp=dict(model.params["mtp"], draft_head=zero)))
    plain = qmtp.generate(qmtp.load(controlled, dtype="float32", progress=False), PROMPTS, max_new_tokens=12)
    res = qmtp.generate(broken, PROMPTS, max_new_tokens=12, mtp_k=3)
    assert res.tokens == plain.tokens and res.stats["acceptance_rate"] < 0.5
    ids = PROMPTS[0] + plain.tokens[0]
    assert qmtp.mtp_logits(model, ids).agreement == 1.0
    assert np.all(qmtp.mtp_logits(broken, ids).logits == 0.0)


@pytest.mark.slow  # CI time: the FP8 draft head and TP2 each stay in CI on their own
def test_fp8_draft_head_under_tp2(controlled):
    one = qmtp.generate(qmtp.load(controlled, dtype="float32", progress=False), PROMPTS, max_new_tokens=8)
    model = qmtp.load(controlled, dtype="float32", progress=False, draft_head="fp8", tp=2)
    assert model.params["mtp"]["draft_head"].weight.sharding.spec == jax.sharding.PartitionSpec("tp", None)
    res = qmtp.generate(model, PROMPTS, max_new_tokens=8, mtp_k=2)
    assert res.tokens == one.tokens and res.stats["acceptance_rate"] == 1.0


def test_bad_draft_head_is_refused(controlled):
    with pytest.raises(ValueError, match=r"draft_head='int4': supported \('auto', 'bf16', 'fp8'\)"):
        qmtp.load(controlled, progress=False, draft_head="int4")


def test_auto_draft_head_follows_the_checkpoint_precision(controlled, tmp_path):
    """draft_head="auto" (the default): the FP8 copy for an FP8 checkpoint, the shared lm_head otherwise."""
    plain = qmtp.load(controlled, dtype="float32", progress=False)
    assert "draft_head" not in plain.params["mtp"] and plain.draft_head == "bf16"
    fp8_dir = make_checkpoint.write_checkpoint(str(tmp_path / "f"), "tiny_controlled", "fp8", seed=2)
    model = qmtp.load(fp8_dir, dtype="float32", progress=False)
    assert isinstance(model.params["mtp"]["draft_head"], fp8.Fp8Block) and model.draft_head == "fp8"
    assert "draft_head" not in qmtp.load(fp8_dir, dtype="float32", progress=False, draft_head="bf16").params["mtp"]


def test_the_breakdown_times_the_draft_head(controlled):
    """bench_breakdown's draft piece drafts through the draft head, as the spec loop does: with a
    zeroed head every draft is id 0 (all logits 0), with the model's own head they are not."""
    from qmtp.api import _new_state
    from qmtp.bench import breakdown as bench_breakdown
    from qmtp.runtime.kernel_config import REF
    model = qmtp.load(controlled, dtype="float32", progress=False, draft_head="fp8")
    head = model.params["mtp"]["draft_head"]
    zero = dict(model.params, mtp=dict(model.params["mtp"], draft_head=fp8.Fp8Block(jnp.zeros_like(head.weight),
                                                                                      head.scale)))

    def drafts(params):
        tok, _ = bench_breakdown.draft_loop(model.cfg, REF, params, _new_state(model, [16, 16]), jnp.int32(3))
        return np.asarray(tok)

    assert np.all(drafts(zero) == 0)
    assert np.any(drafts(model.params) != 0)
