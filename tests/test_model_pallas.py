"""The model with impl="pallas" (kernels in interpret mode on the CPU) against impl="ref"."""

import dataclasses
import os

import numpy as np
import pytest

import qmtp
from tolerance import F32_MODEL, assert_close

ORACLE = os.path.join(os.path.dirname(__file__), "fixtures", "oracle", "qwen3_5")


@pytest.mark.slow  # ~15 s; the FP8 test below runs the same Pallas model path (logits and MTP tokens) in CI
def test_pallas_impl_matches_ref_logits_and_mtp_tokens():
    ref = qmtp.load(ORACLE, dtype="float32")
    pallas = dataclasses.replace(ref, impl="pallas")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 250, n).tolist() for n in (5, 19)]
    assert_close(qmtp.target_logits(pallas, prompts[1]), qmtp.target_logits(ref, prompts[1]), F32_MODEL, "logits")
    want = qmtp.generate(ref, prompts, max_new_tokens=6, stop_token_ids=[], mtp_k=2)
    got = qmtp.generate(pallas, prompts, max_new_tokens=6, stop_token_ids=[], mtp_k=2)
    assert got.tokens == want.tokens


def test_pallas_impl_on_an_fp8_checkpoint_matches_ref(tmp_path):
    from qmtp.tools import make_checkpoint
    path = make_checkpoint.write_checkpoint(str(tmp_path / "fp8"), "tiny", "fp8", seed=2)
    ref = qmtp.load(path, dtype="float32")
    pallas = dataclasses.replace(ref, impl="pallas")
    ids = list(range(3, 24))
    assert_close(qmtp.target_logits(pallas, ids), qmtp.target_logits(ref, ids), F32_MODEL, "fp8 logits")
    want = qmtp.generate(ref, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=1)
    assert qmtp.generate(pallas, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=1).tokens == want.tokens


@pytest.mark.slow  # ~60 s; off by default (fp8_config.X_CHUNK_SCALED): the kernel's exact cases run in CI
def test_in_kernel_scaled_piece_keeps_mtp_equal_to_plain(tmp_path, monkeypatch):
    """bf16 activations (the path the f16 pieces serve) with the scaled piece made in the kernel:
    greedy MTP K=2 tokens equal plain greedy tokens, and the 21-token prompt's logits equal the
    default path's bit for bit: at 9-32 rows the default takes one scaled f16 piece per row, and a
    piece scaled per row or per chunk holds the same products times powers of two, so every f32 sum
    rounds alike (1-8 rows use two pieces, whose sums may round differently)."""
    import jax

    from pallas_kernels import fp8_kernels
    from qmtp import ops
    from qmtp.tools import make_checkpoint
    made = []  # chunks whose piece the kernel made, counted as the kernels are traced
    inner = fp8_kernels._chunk_scaled
    monkeypatch.setattr(fp8_kernels, "_chunk_scaled", lambda xc: made.append(xc.shape) or inner(xc))
    path = make_checkpoint.write_checkpoint(str(tmp_path / "fp8"), "tiny_tp", "fp8", seed=2)
    model = qmtp.load(path, dtype="bfloat16", progress=False, impl="pallas")
    ids = list(range(3, 24))
    default = np.asarray(qmtp.target_logits(model, ids), np.float32)
    jax.clear_caches()
    before = ops.set_kernel_settings({"fp8_x_chunk_scaled": True})
    try:
        got = np.asarray(qmtp.target_logits(model, ids), np.float32)
        plain = qmtp.generate(model, [ids[:6]], max_new_tokens=6, stop_token_ids=[], mtp_k=0)
        mtp = qmtp.generate(model, [ids[:6]], max_new_tokens=6, stop_token_ids=[], mtp_k=2)
    finally:
        ops.set_kernel_settings(before)
        jax.clear_caches()
    assert mtp.tokens == plain.tokens
    np.testing.assert_array_equal(got, default)
    assert made and {r for r, _ in made} >= {16, 32}  # 1-row steps (16-row dot) and the 21-row prompt


@pytest.mark.slow  # ~90 s; the kernel's exact cases and lowering run in CI
def test_gemm_scaled_piece_keeps_prefill_logits_and_mtp_equal_to_plain(tmp_path, monkeypatch):
    """bf16 activations with the GEMM's scaled f16 piece (the default since session 19): a 70-token
    prompt (its FP8 launches of 70 rows run on the GEMM with fp8_decode_max_rows=64; the default
    streams up to 128 rows on the decode grid) gives logits as close to the f32 model's as
    the bf16 dot's path (fp8_gemm_x_f16_scaled=false; the piece is exact, only the order of the f32
    sums inside a dot may differ, as between any two dot implementations), and greedy MTP K=2 equals
    plain."""
    import jax

    from pallas_kernels import fp8_config, fp8_matmul
    from qmtp import ops
    from qmtp.tools import make_checkpoint
    from tolerance import BF16_MODEL
    rows = []  # the row counts whose scaled piece the GEMM took, counted as the launches are traced
    inner = fp8_matmul._f16_scaled
    monkeypatch.setattr(fp8_matmul, "_f16_scaled", lambda x2: rows.append(x2.shape[0]) or inner(x2))
    path = make_checkpoint.write_checkpoint(str(tmp_path / "fp8"), "tiny_tp", "fp8", seed=3)
    model = qmtp.load(path, dtype="bfloat16", progress=False, impl="pallas")
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 250, 70)]
    monkeypatch.setattr(fp8_config, "DECODE_MAX_ROWS", 64)
    f32 = np.asarray(qmtp.target_logits(qmtp.load(path, dtype="float32", progress=False), ids), np.float32)
    got = np.asarray(qmtp.target_logits(model, ids), np.float32)
    plain = qmtp.generate(model, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=0)
    mtp = qmtp.generate(model, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=2)
    assert 70 in rows
    rows.clear()
    jax.clear_caches()
    before = ops.set_kernel_settings({"fp8_gemm_x_f16_scaled": False})
    try:
        bf16_dot = np.asarray(qmtp.target_logits(model, ids), np.float32)
    finally:
        ops.set_kernel_settings(before)
        jax.clear_caches()
    assert 70 not in rows
    assert_close(bf16_dot, f32, BF16_MODEL, "the GEMM's bf16 dot vs f32")
    assert_close(got, f32, BF16_MODEL, "the GEMM's f16 piece vs f32")
    assert mtp.tokens == plain.tokens
