"""FP8 activations (pallas_kernels/fp8_act_quant.py, MODEL_SPEC §5.3) and the decode kernel on them
(`fp8_matmul(..., act_quant=True)`): the quantizer and the reference against an independent numpy
float64 formula (ml_dtypes' E4M3 rounding), the kernel in interpret mode against the reference on
ragged shapes over its tile options, and the lowering for the H200 (both operands of the dot E4M3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from h200_lowering import lower_for_h200, triton_calls
from marks import slow_except
from pallas_kernels import fp8_act_quant as aq
from pallas_kernels import fp8_matmul as fm
from pallas_kernels.fp8_config import DecodeConfig, PrefillConfig

E4M3 = ml_dtypes.float8_e4m3fn


def np_quantize(x: np.ndarray):
    """§5.3 in float64 (the division and clamp in f32, as the kernel's XLA op does), E4M3 by ml_dtypes."""
    m, i = x.shape
    g = -(-i // 128)
    xf = np.zeros((m, g * 128), np.float32)
    xf[:, :i] = x
    s = (np.maximum(np.abs(xf.reshape(m, g, 128)).max(-1), np.float32(1e-10)) / np.float32(448)).astype(np.float32)
    q = np.clip(xf.reshape(m, g, 128) / s[..., None], -448, 448).astype(np.float32).astype(E4M3)
    return q.reshape(m, g * 128)[:, :i], s


def np_matmul_a8(x, wq, scale):
    q, s = np_quantize(x)
    m, i = x.shape
    o = wq.shape[0]
    y = np.zeros((m, o))
    for g in range(s.shape[1]):
        cols = slice(g * 128, min(i, (g + 1) * 128))
        part = q[:, cols].astype(np.float64) @ wq[:, cols].astype(np.float64).T  # [M, O], exact
        y += part * s[:, g:g + 1].astype(np.float64) * np.repeat(scale[:, g].astype(np.float64), 128)[:o][None]
    return y


def problem(rng, m, o, i):
    x = (rng.standard_normal((m, i)) * np.exp(rng.standard_normal((m, 1)))).astype(np.float32)
    x[:, ::7] *= 30.0  # outliers: the rest of their group quantizes coarsely
    wq = (rng.standard_normal((o, i)) * 4).astype(np.float32).astype(E4M3)
    scale = rng.uniform(0.01, 0.1, (-(-o // 128), -(-i // 128))).astype(np.float32)
    return x, wq, scale


def test_quantize_follows_the_spec():
    rng = np.random.default_rng(0)
    x, _, _ = problem(rng, 3, 8, 300)
    x[1, 128:256] = 0.0  # an all-zero group: the scale floor, zeros out
    q, s = aq.quantize_activations(jnp.asarray(x))
    want_q, want_s = np_quantize(x)
    # XLA may divide by 448 as a multiply by its reciprocal (1 ulp); then the E4M3 rounding of x / s
    # from the scales it made must be exact
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=2.0**-22, atol=0)
    s_used = np.asarray(s)
    m, i = x.shape
    want_q = np.clip(x / np.repeat(s_used, 128, axis=1)[:, :i], -448, 448).astype(np.float32).astype(E4M3)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want_q.astype(np.float32))
    assert float(np.abs(np.asarray(q).astype(np.float32)).max()) == 448.0  # each group's max maps to 448
    assert np.asarray(q)[1, 128:256].astype(np.float32).max() == 0.0


@pytest.mark.parametrize("m, o, i", [(1, 272, 300), (5, 130, 129), (16, 256, 512)])
def test_reference_against_float64(m, o, i):
    rng = np.random.default_rng(m + o + i)
    x, wq, scale = problem(rng, m, o, i)
    got = np.asarray(aq.fp8_matmul_act_ref(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(scale), jnp.float32))
    want = np_matmul_a8(x, wq, scale)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))  # f32 sums of exact products
    exact = x.astype(np.float64) @ (wq.astype(np.float64) * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:o, :i]).T
    err = np.max(np.abs(got - exact)) / np.max(np.abs(exact))
    assert 1e-4 < err < 0.1, err  # the activations' quantization, visible but bounded


CONFIGS = {
    "swap_split2": DecodeConfig(split_k=2),
    "noswap": DecodeConfig(swap_ab=False),
    "bo32_split3_preload": DecodeConfig(block_o=32, split_k=3, scale_preload=True),
    "x_f16_ignored": DecodeConfig(split_k=2, x_f16=True),
    "default": None,  # the default configs (9-32 rows take the scaled f16 piece, which E4M3 x replaces)
}


@pytest.mark.parametrize("name", slow_except(CONFIGS, {"default"}))
def test_kernel_matches_the_reference(name):  # the other tiles `slow` (CI time)
    """Ragged O and I (the uint8 path fills the columns past I with 0), M padded to the dot's 16
    rows, bf16 and f32 x; NaN in a padding row of x cannot reach the others (rows are independent)."""
    config = CONFIGS[name]
    rng = np.random.default_rng(len(name))
    for m, (o, i), x_dtype in [(1, (272, 300), jnp.bfloat16), (5, (130, 129), jnp.float32),
                               (16, (256, 512), jnp.bfloat16), (3, (64, 256), jnp.float32)]:
        x, wq, scale = problem(rng, m, o, i)
        xj = jnp.asarray(x, x_dtype)
        got = fm.fp8_matmul(xj, jnp.asarray(wq), jnp.asarray(scale), jnp.float32, interpret=True, config=config,
                            act_quant=True)
        want = aq.fp8_matmul_act_ref(xj, jnp.asarray(wq), jnp.asarray(scale), jnp.float32)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        assert err < 1e-5, (name, m, o, i, err)


def test_several_weights_share_one_launch():
    rng = np.random.default_rng(4)
    x, w1, s1 = problem(rng, 4, 130, 300)
    _, w2, s2 = problem(rng, 4, 64, 300)
    y1, y2 = fm.fp8_matmul_many(jnp.asarray(x), (w1, w2), (s1, s2), jnp.float32, interpret=True, act_quant=True)
    for y, w, s in ((y1, w1, s1), (y2, w2, s2)):
        want = aq.fp8_matmul_act_ref(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s), jnp.float32)
        assert float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want))) < 1e-5


def test_act_quant_limits():
    rng = np.random.default_rng(1)
    x, wq, scale = problem(rng, 2, 64, 256)
    with pytest.raises(ValueError, match="act_quant runs on the decode kernel"):
        fm.fp8_matmul(jnp.asarray(x), wq, scale, interpret=True, config=PrefillConfig(), act_quant=True)


@pytest.mark.parametrize("i, bitcast", [(5120, False), (300, True)])
def test_lowers_for_h200_with_e4m3_on_both_sides_of_the_dot(i, bitcast):
    """One Triton call whose dot takes E4M3 on both sides and no weight conversion; the uint8 bits
    only where I is ragged."""
    sds = jax.ShapeDtypeStruct
    args = (sds((1, i), jnp.bfloat16), sds((6144, i), jnp.float8_e4m3fn), sds((48, -(-i // 128)), jnp.float32))
    lowered = lower_for_h200(lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16, act_quant=True), args)
    [(_, ir_text)] = triton_calls(lowered)
    dots = [ln for ln in ir_text.splitlines() if "tt.dot " in ln]
    assert len(dots) == 1 and dots[0].count("f8E4M3FN>") == 2, dots
    # W on the dot's M side (64 rows) and K = 128 products per imprecise sum: what Triton needs to
    # use Hopper's FP8 wgmma instead of converting both operands for mma.sync (pallas_kernels/_fp8_dot.py)
    assert "tensor<64x128xf8E4M3FN> * tensor<128x16xf8E4M3FN>" in dots[0], dots
    assert "maxNumImpreciseAcc = 128" in dots[0], dots
    assert not [ln for ln in ir_text.splitlines() if "tt.fp_to_fp" in ln and "f8E4M3FN" in ln]  # no conversion
    assert ("tt.bitcast" in ir_text) == bitcast


def test_only_fp8_dots_get_the_imprecise_accumulation():
    """The exact path's f16 dot is built as before (no maxNumImpreciseAcc), and installing twice
    wraps the lowering once."""
    from pallas_kernels import _fp8_dot
    from jax._src.pallas.triton import lowering
    assert _fp8_dot.install() and _fp8_dot.install()
    assert isinstance(lowering.tt_dialect, _fp8_dot._Fp8DotDialect)
    assert not isinstance(lowering.tt_dialect._dialect, _fp8_dot._Fp8DotDialect)
    sds = jax.ShapeDtypeStruct
    args = (sds((1, 5120), jnp.bfloat16), sds((6144, 5120), jnp.float8_e4m3fn), sds((48, 40), jnp.float32))
    [(_, ir_text)] = triton_calls(lower_for_h200(lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16), args))
    dots = [ln for ln in ir_text.splitlines() if "tt.dot " in ln]
    assert len(dots) == 1 and "xf16>" in dots[0] and "maxNumImpreciseAcc" not in dots[0], dots


def test_a8_sweep_candidates_are_valid_and_exact():
    """The bench's E4M3-activation sweep (`--fp8_a8_sweep`): every candidate passes check_config with
    W on the dot's M side; the widest and the most split ones match the reference."""
    from pallas_kernels.bench import fp8 as fp8_bench
    from pallas_kernels import fp8_config
    candidates = fp8_bench.a8_candidate_configs()
    assert len(candidates) == len(set(candidates)) == 12
    for c in candidates:
        fp8_config.check_config(c, 16)
        assert c.swap_ab and c.block_o in (64, 128)
    rng = np.random.default_rng(6)
    x, wq, scale = problem(rng, 4, 272, 1100)
    want = aq.fp8_matmul_act_ref(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(scale), jnp.float32)
    for c in (candidates[-1], candidates[4]):  # block_o 128 x 8 warps x split 8; 128 x 4 x split 1
        got = fm.fp8_matmul(jnp.asarray(x), jnp.asarray(wq), jnp.asarray(scale), jnp.float32, interpret=True,
                            config=c, act_quant=True)
        assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-5, c
