"""RMSNorm + the FP8 decode kernel's x operand in one launch (pallas_kernels/norm_operand.py).

The ref against a float64 formula; the kernel (interpret mode on the CPU) against the ref: its bf16
rows within one rounding of the ref's (the row sum runs in another order), and its operand the very
bits that fp8_kernels' XLA helpers make from the kernel's own rows. Lowered for the H200 in CI; on
the GPU (`gpu`) the same checks at the 27B width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import norm_operand as no
from pallas_kernels.fp8_kernels import X_F16_HI, _f16_pieces, _f16_scaled

EPS = 1e-6


def problem(rng, m, e, *, scale=1.0):
    x = (rng.standard_normal((m, e)) * scale).astype(np.float32)
    w = (rng.standard_normal(e) * 0.5).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)


def f64_norm(x, w):
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * (1.0 + w)


def as_f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def check_operand(y, rows, row_scale, form):
    """rows / row_scale are what the XLA helpers make from y, bit for bit, and represent y exactly."""
    m = y.shape[0]
    if form == "pieces":
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(_f16_pieces(y).reshape(2 * m, -1)))
        back = as_f32(rows[:m]) * X_F16_HI + as_f32(rows[m:])
        assert row_scale is None
    else:
        want_rows, want_scale = _f16_scaled(y)
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(want_rows))
        np.testing.assert_array_equal(np.asarray(row_scale), np.asarray(want_scale))
        back = as_f32(rows) * np.asarray(row_scale)
    np.testing.assert_array_equal(back, as_f32(y))


@pytest.mark.parametrize("form", no.FORMS)
def test_ref_matches_float64_formula(form):
    x, w = problem(np.random.default_rng(0), 3, 200)
    y, rows, row_scale = no.rms_norm_operand_ref(x, w, EPS, form)
    np.testing.assert_allclose(as_f32(y), f64_norm(x, w), rtol=2 ** -8, atol=1e-6)
    check_operand(y, rows, row_scale, form)


CASES = [(1, 64, "pieces", None), (3, 200, "pieces", 64), (8, 320, "pieces", 128), (9, 200, "scaled", 64),
         (16, 64, "scaled", None), (5, 130, "scaled", 32)]  # (M, E, form, lanes per program)


@pytest.mark.parametrize("m,e,form,lanes", CASES)
def test_kernel_matches_ref(m, e, form, lanes):
    """Ragged widths (lanes past E masked), one or several programs per row (the last one ragged),
    1-16 rows, both forms; rows with huge values (|y| >= 2^15, past the add-and-subtract rounding's
    range) and a zero row among them."""
    rng = np.random.default_rng(m * 1000 + e)
    x, w = problem(rng, m, e)
    w = w.at[: e // 4].set(2.0 ** 17)  # 1 + w large: y values >= 2^15 on those lanes
    x = x.at[m - 1].set(0.0)
    y, rows, row_scale = no.rms_norm_operand(x, w, EPS, form, interpret=True, slice_lanes=lanes)
    ry, _, _ = no.rms_norm_operand_ref(x, w, EPS, form)
    assert y.dtype == jnp.bfloat16 and rows.shape == ((2 * m if form == "pieces" else m), e)
    np.testing.assert_allclose(as_f32(y), as_f32(ry), rtol=2 ** -7, atol=0)  # one bf16 rounding apart at most
    check_operand(y, rows, row_scale, form)


def test_rows_are_independent():
    """A NaN row stays in its row: the others equal the same rows normed alone."""
    x, w = problem(np.random.default_rng(1), 4, 96)
    y, rows, _ = no.rms_norm_operand(x.at[2].set(jnp.nan), w, EPS, "pieces", interpret=True, slice_lanes=32)
    alone, _, _ = no.rms_norm_operand(x[:2], w, EPS, "pieces", interpret=True, slice_lanes=32)
    np.testing.assert_array_equal(as_f32(y[:2]), as_f32(alone))
    assert np.all(np.isnan(as_f32(y[2]))) and np.all(np.isfinite(as_f32(y[np.array([0, 1, 3])])))


def test_round_half_even_matches_numpy():
    v = np.concatenate([np.arange(-8, 8) + 0.5, [2.0 ** 22 + 0.5, -(2.0 ** 22) - 0.5, 2.0 ** 23 + 2, 2.0 ** 24 - 1, 3.25, -1e30, 0.0],
                        np.random.default_rng(2).standard_normal(64) * 1e3]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(no._round_half_even)(jnp.asarray(v))), np.round(v))


def test_rejects_bad_inputs():
    x, w = problem(np.random.default_rng(3), 2, 64)
    with pytest.raises(ValueError, match="form='bf16'"):
        no.rms_norm_operand(x, w, EPS, "bf16")
    with pytest.raises(ValueError, match=r"x must be \[M, E\] bfloat16"):
        no.rms_norm_operand(x.astype(jnp.float32), w, EPS, "pieces")
    with pytest.raises(ValueError, match=r"w \(32,\) does not match x's last dim 64"):
        no.rms_norm_operand(x, w[:32], EPS, "pieces")
    with pytest.raises(ValueError, match="slice_lanes=48 must be a power of two"):
        no.rms_norm_operand(x, w, EPS, "pieces", slice_lanes=48)


@pytest.mark.parametrize("form", no.FORMS)
def test_kernel_lowers_for_h200(form):
    from h200_lowering import lower_for_h200, triton_calls
    x = jax.ShapeDtypeStruct((4, 5120), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((5120,), jnp.bfloat16)
    calls = triton_calls(lower_for_h200(lambda a, b: no.rms_norm_operand(a, b, EPS, form), (x, w)))
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("m,form", [(1, "pieces"), (5, "pieces"), (16, "scaled"), (32, "scaled")])
def test_gpu_kernel_matches_ref_at_the_27b_width(m, form):
    from test_kernel_fp8_matmul import gpu_required
    gpu_required()
    x, w = problem(np.random.default_rng(m), m, 5120, scale=3.0)
    y, rows, row_scale = no.rms_norm_operand(x, w, EPS, form)
    ry, _, _ = jax.jit(no.rms_norm_operand_ref, static_argnums=(2, 3))(x, w, EPS, form)
    np.testing.assert_allclose(as_f32(y), as_f32(ry), rtol=2 ** -7, atol=0)
    check_operand(y, rows, row_scale, form)


# ------------------------------------------------------------------------------------------------
# In the model: ops.rms_norm_linear_many (ops.NORM_OPERAND_LAUNCH) and the FP8 kernel's x_operand
# ------------------------------------------------------------------------------------------------

def fp8_weights(rng, o, i):
    from qmtp.fp8 import Fp8Block
    w = jnp.asarray(rng.standard_normal((o, i)) * 0.5, jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (-(-o // 128), -(-i // 128))), jnp.float32)
    return Fp8Block(w, scale)


@pytest.fixture
def norm_operand_on():
    from qmtp import ops
    before = ops.set_kernel_settings({"norm_operand_launch": True})
    yield
    ops.set_kernel_settings(before)


@pytest.mark.parametrize("m", [1, 5, 12])  # pieces, pieces, scaled
def test_rms_norm_linear_many_is_the_matmul_of_the_kernels_rows(m, norm_operand_on):
    """The fused path gives what the FP8 kernel gives on the kernel's own normed rows, bit for bit
    (the operand is the one fp8_matmul would have made), and the unfused path's result within the
    norm's one bf16 rounding."""
    from pallas_kernels import fp8_matmul as fm
    from qmtp import layers, ops
    rng = np.random.default_rng(m)
    x, w = problem(rng, m, 200, scale=2.0)
    ws = (fp8_weights(rng, 130, 200), fp8_weights(rng, 96, 200))
    got = ops.rms_norm_linear_many(x.reshape(1, m, 200), w, EPS, ws, "pallas")
    assert got is not None and [g.shape for g in got] == [(1, m, 130), (1, m, 96)]
    y, _, _ = no.rms_norm_operand(x, w, EPS, fm.x_operand_form(m, 226, 200), interpret=True)
    want = fm.fp8_matmul_many(y, [a.weight for a in ws], [a.scale for a in ws], interpret=True)
    for g, wnt in zip(got, want):
        np.testing.assert_array_equal(as_f32(g[0]), as_f32(wnt))
    unfused = ops.linear_many(layers.rms_norm(x, w, EPS), ws, "pallas")
    for g, u in zip(got, unfused):
        np.testing.assert_allclose(as_f32(g[0]), as_f32(u), rtol=0.05, atol=0.05 * float(np.abs(as_f32(u)).max()))


def test_rms_norm_linear_many_applies_only_where_it_can(norm_operand_on):
    from qmtp import ops
    rng = np.random.default_rng(4)
    x, w = problem(rng, 3, 200)
    ws = (fp8_weights(rng, 130, 200),)
    assert ops.rms_norm_linear_many(x, w, EPS, ws, "ref") is None
    assert ops.rms_norm_linear_many(x.astype(jnp.float32), w, EPS, ws, "pallas") is None  # f32 x: no f16 pieces
    assert ops.rms_norm_linear_many(jnp.zeros((40, 200), jnp.bfloat16), w, EPS, ws, "pallas") is None  # prefill GEMM
    ops.set_kernel_settings({"norm_operand_launch": False})
    assert ops.rms_norm_linear_many(x, w, EPS, ws, "pallas") is None


def test_fp8_matmul_rejects_an_operand_of_another_form():
    from pallas_kernels import fp8_matmul as fm
    rng = np.random.default_rng(5)
    x, w = problem(rng, 3, 200)
    f = fp8_weights(rng, 130, 200)
    y, rows, scale = no.rms_norm_operand(x, w, EPS, "scaled", interpret=True)
    with pytest.raises(ValueError, match="x_operand in form 'scaled', but .* takes pieces"):
        fm.fp8_matmul_many(y, [f.weight], [f.scale], interpret=True, x_operand=("scaled", rows, scale))
    with pytest.raises(ValueError, match="x_operand is for the decode kernel"):
        fm.fp8_matmul_many(y, [f.weight], [f.scale], interpret=True, act_quant=True, x_operand=("scaled", rows, scale))


def test_bf16_fp8_model_logits_with_the_norm_in_one_launch(tmp_path, monkeypatch):
    """The tiny FP8 checkpoint in bf16 with impl="pallas": every layer's MLP norm runs as the kernel
    (counted while the forward traces) and the logits stay within bf16 noise of the XLA norm's, at 3
    (pieces) and 12 (scaled) teacher-forced rows."""
    import dataclasses

    import qmtp
    from qmtp import ops
    from qmtp.tools import make_checkpoint
    path = make_checkpoint.write_checkpoint(str(tmp_path / "fp8"), "tiny", "fp8", seed=2)
    model = dataclasses.replace(qmtp.load(path, dtype="bfloat16"), impl="pallas")
    forms = []
    kernel = no.rms_norm_operand
    monkeypatch.setattr(no, "rms_norm_operand", lambda x, w, eps, form, **kw: forms.append(form) or kernel(
        x, w, eps, form, **kw))
    ids = list(range(3, 15))
    for n, form in ((3, "pieces"), (12, "scaled")):
        jax.clear_caches()
        before = ops.set_kernel_settings({"norm_operand_launch": True})
        try:
            forms.clear()
            fused = qmtp.target_logits(model, ids[:n])
        finally:
            ops.set_kernel_settings(before)
            jax.clear_caches()
        assert len(forms) >= 2 and set(forms) == {form}, forms  # attention and GDN layers (traced once per kind at least)
        plain = qmtp.target_logits(model, ids[:n])
        scale = float(np.abs(plain).max())
        np.testing.assert_allclose(fused, plain, rtol=0, atol=0.05 * scale, err_msg=f"{n} rows")
