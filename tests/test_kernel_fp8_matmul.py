"""FP8 block-scaled matmul: the ref against a float64 formula, the Pallas kernel against the ref.

CPU: the kernels run with interpret=True on small ragged shapes. In interpret mode a read past the
end of an array returns NaN (Pallas pads with its "uninitialized" value) and output slots no program
stores to stay NaN, so a missing mask or an unwritten tile shows up as a non-finite result
(`assert_close` rejects those); `test_interpret_mode_poisons_out_of_bounds` proves the poison is
really there. Integer-valued problems make every sum exact in f32, so there the kernel must equal the
ref bit for bit whatever its accumulation order, config or raggedness.

CI also lowers the kernels for the H200 from the CPU (the StableHLO with the Triton custom call and
the Triton module inside it). What that cannot catch: Triton's own passes (TTIR -> TTGIR -> PTX:
layouts, shared memory, registers) run only when XLA compiles on a GPU, i.e. in the `gpu` tests:
    JAX_PLATFORMS=cuda PYTHONPATH=. python -m pytest -q -m gpu tests/test_kernel_fp8_matmul.py
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import jax.extend.core
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import fp8_config as fc
from pallas_kernels import fp8_kernels, fp8_layout
from pallas_kernels import fp8_matmul as fm
from pallas_kernels.fp8_config import DecodeConfig, PrefillConfig
from qmtp.model.fp8 import quantize_np
from marks import slow_except
from tolerance import assert_close
from h200_lowering import lower_for_h200, triton_calls, attr_int

E4M3 = ml_dtypes.float8_e4m3fn
F32_EPS = 2.0**-24  # unit roundoff of f32
# One bf16 ulp relative to the value (8 significant bits: ulp(v) <= 2^-7 |v|). Two f32 results that
# agree to ~1e-6 can still round to neighbouring bf16 values, at most one ulp apart.
BF16_ULP = 2.0**-7


def f32_accum_tol(n_terms: int) -> float:
    """Two f32 evaluations of the same I-term sums in different orders (kernel: exact products,
    per-128-chunk sums, scale, chunk sums; ref: dequantized weights, one dot): each of the ~I
    roundings adds an independent error <= 2^-24 of a partial sum bounded by ~max|y|, so the
    difference is a random walk of about sqrt(I) * 2^-24 * max|y|. Factor 8: both sides, and the
    tail over a few hundred cases (measured: at most 0.7 * sqrt(I) * 2^-24)."""
    return 8.0 * math.sqrt(n_terms) * F32_EPS


def out_tol(n_terms: int, out_dtype) -> float:
    tol = f32_accum_tol(n_terms)
    return tol + BF16_ULP if jnp.dtype(out_dtype) == jnp.bfloat16 else tol


# ------------------------------------------------------------------------------------------------
# problems
# ------------------------------------------------------------------------------------------------


def f64_formula(x, wq, scale, block=128):
    """y[t, o] = sum over scale blocks (bo, bi) of scale[bo, bi] * x[t, block bi] . w[o in bo, block bi]."""
    x = np.asarray(x, np.float64).reshape(-1, wq.shape[1])
    o, i = wq.shape
    y = np.zeros((x.shape[0], o), np.float64)
    for bo in range(scale.shape[0]):
        for bi in range(scale.shape[1]):
            rows, cols = slice(bo * block, min((bo + 1) * block, o)), slice(bi * block, min((bi + 1) * block, i))
            y[:, rows] += float(scale[bo, bi]) * (x[:, cols] @ np.asarray(wq[rows, cols], np.float64).T)
    return y


def random_problem(rng, m, o, i, x_dtype, lead=None):
    """Gaussian weights whose 128x128 blocks differ in magnitude by up to 2^12 (so a scale applied to
    the wrong block is a large error), quantized with the project's quantize_np; gaussian x."""
    gain = 4.0 ** rng.integers(-3, 4, (-(-o // 128), -(-i // 128)))
    gain = np.repeat(np.repeat(gain, 128, 0), 128, 1)[:o, :i]
    wq, scale = quantize_np((rng.standard_normal((o, i)) * gain).astype(np.float32))
    x = rng.standard_normal((*(lead or (m,)), i)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, x_dtype).astype(jnp.float32))  # the values the kernel sees
    return x, wq, scale


def exact_problem(rng, m, o, i, x_dtype=jnp.bfloat16):
    """Integers |x| <= 4, E4M3 integers |w| <= 16 (exact in E4M3), scales 2^-3 .. 2^3: every product
    and partial sum is a multiple of 2^-3 below 2^17, so f32 arithmetic is exact in any order."""
    x = rng.integers(-4, 5, (m, i)).astype(np.float32)
    wq = rng.integers(-16, 17, (o, i)).astype(np.float32).astype(E4M3)
    scale = (2.0 ** rng.integers(-3, 4, (-(-o // 128), -(-i // 128)))).astype(np.float32)
    return x, wq, scale


# jitted once per signature (an eager interpret-mode pallas_call is re-lowered on every call)
_kernel = jax.jit(fm.fp8_matmul, static_argnums=(3,), static_argnames=("interpret", "config"))
_ref = jax.jit(fm.fp8_matmul_ref, static_argnums=(3,))


def run_kernel(x, wq, scale, x_dtype, out_dtype, config=None, interpret=True):
    y = _kernel(jnp.asarray(x, x_dtype), jnp.asarray(wq), jnp.asarray(scale), jnp.dtype(out_dtype),
                interpret=interpret, config=config)
    assert y.dtype == jnp.dtype(out_dtype) and y.shape == (*np.shape(x)[:-1], wq.shape[0])
    return np.asarray(y.astype(jnp.float32))


def run_ref(x, wq, scale, x_dtype, out_dtype):
    y = _ref(jnp.asarray(x, x_dtype), jnp.asarray(wq), jnp.asarray(scale), jnp.dtype(out_dtype))
    return np.asarray(y.astype(jnp.float32))


SHAPES = [(272, 160), (64, 300), (384, 256), (130, 129)]  # (O, I): ragged rows, columns, both
ROWS = [1, 3, 16, 24, 40, 130]  # up to 128: decode kernel (24, 40: a batched verify's configs), 130: the GEMM


# ------------------------------------------------------------------------------------------------
# the ref against float64
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("o,i", SHAPES + [(128, 128), (1, 1)])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_ref_matches_float64_formula(o, i, x_dtype):
    rng = np.random.default_rng(o * 1000 + i)
    x, wq, scale = random_problem(rng, 5, o, i, x_dtype)
    want = f64_formula(x, wq, scale)
    assert_close(run_ref(x, wq, scale, x_dtype, jnp.float32), want, f32_accum_tol(i), "ref vs float64")
    assert_close(run_ref(x, wq, scale, x_dtype, jnp.bfloat16), want, out_tol(i, jnp.bfloat16), "ref bf16 out")
    xe, we, se = exact_problem(rng, 5, o, i)
    np.testing.assert_array_equal(run_ref(xe, we, se, x_dtype, jnp.float32), f64_formula(xe, we, se))


def test_ref_uses_the_block_of_each_element():
    """One nonzero weight per block, one scale per block: y picks exactly scale[o // 128, i // 128]."""
    o, i = 272, 300
    scale = np.arange(1, 1 + 3 * 3, dtype=np.float32).reshape(3, 3)
    wq = np.zeros((o, i), E4M3)
    x = np.zeros((1, i), np.float32)
    for r, c in [(0, 0), (127, 128), (128, 127), (271, 299), (200, 260)]:
        wq[:] = 0
        x[:] = 0
        wq[r, c], x[0, c] = 1.0, 1.0
        y = run_ref(x, wq, scale, jnp.float32, jnp.float32)
        assert y[0, r] == scale[r // 128, c // 128] and np.count_nonzero(y) == 1, (r, c)
        y = run_kernel(x, wq, scale, jnp.float32, jnp.float32)
        assert y[0, r] == scale[r // 128, c // 128] and np.count_nonzero(y) == 1, (r, c)


# ------------------------------------------------------------------------------------------------
# the kernel against the ref (interpret mode)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("o,i", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_kernel_matches_ref(m, o, i):
    """Default config (decode kernel for M <= 128, GEMM above), f32 output: tight f32 tolerance. x is
    bf16 or f32 in a checkerboard over (M, shape), so every M and every shape sees both (each
    interpret-mode compile costs ~0.4 s of CPU; the full product would double the file's time)."""
    x_dtype = (jnp.bfloat16, jnp.float32)[(ROWS.index(m) + SHAPES.index((o, i))) % 2]
    rng = np.random.default_rng(m * 7 + o + i)
    x, wq, scale = random_problem(rng, m, o, i, x_dtype)
    assert_close(run_kernel(x, wq, scale, x_dtype, jnp.float32), run_ref(x, wq, scale, x_dtype, jnp.float32),
                 f32_accum_tol(i), f"kernel vs ref m={m} o={o} i={i} x={jnp.dtype(x_dtype).name}")


@pytest.mark.parametrize("m,o,i", [(1, 272, 160), (5, 130, 129), (16, 64, 300), (40, 384, 256)])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_bf16_output(m, o, i, x_dtype):
    rng = np.random.default_rng(m + o + i)
    x, wq, scale = random_problem(rng, m, o, i, x_dtype)
    got = run_kernel(x, wq, scale, x_dtype, jnp.bfloat16)
    assert_close(got, run_ref(x, wq, scale, x_dtype, jnp.bfloat16), out_tol(i, jnp.bfloat16), "bf16 out vs ref")
    assert_close(got, f64_formula(x, wq, scale), out_tol(i, jnp.bfloat16), "bf16 out vs float64")


CONFIGS = {  # name: (config, rows)
    "decode_default": (None, [1, 16]),
    "decode_one_row_w_on_m": (DecodeConfig(), [1]),
    "decode_noswap_bo32": (DecodeConfig(block_o=32, swap_ab=False), [1, 2, 16]),
    "decode_split2_bo128": (DecodeConfig(block_o=128, split_k=2), [5]),
    "decode_split3_bo16": (DecodeConfig(block_o=16, split_k=3), [3]),  # uneven chunk runs
    "decode_split8": (DecodeConfig(split_k=8), [4]),  # more splits than chunks: clipped
    # a batched verify's rows on the decode grid: BM = 32, 64 and 128, ragged M padded inside the tile
    "decode_dot_verify_rows": (DecodeConfig(split_k=2), [32, 40, 64, 128]),
    # scales loaded once per program as a vector (3 splits of I = 300 -> runs of 1; 2 chunks at 129)
    "decode_dot_scale_preload": (DecodeConfig(split_k=3, scale_preload=True), [1, 5]),
    "decode_dot_scale_preload_bo16": (DecodeConfig(block_o=16, scale_preload=True), [2]),
    # bf16 x as two f16 pieces (f32 x, alternated in, ignores the flag): W on either side of the dot
    "decode_dot_x_f16": (DecodeConfig(split_k=2, x_f16=True, scale_preload=True), [1, 5, 12]),  # 12: BM = 32
    "decode_dot_x_f16_noswap": (DecodeConfig(block_o=32, swap_ab=False, x_f16=True), [2, 24]),
    # bf16 x as one f16 piece per row, scaled by a power of two per row: up to 128 rows (BM = 128)
    "decode_dot_x_f16_scaled": (DecodeConfig(split_k=2, x_f16=True, x_f16_scaled=True, scale_preload=True),
                                [1, 16, 40, 100]),
    "decode_dot_x_f16_scaled_noswap": (DecodeConfig(block_o=32, swap_ab=False, x_f16=True, x_f16_scaled=True), [5]),
    "prefill_16x16": (PrefillConfig(block_m=16, block_n=16), [1, 17]),
    "prefill_32x64": (PrefillConfig(block_m=32, block_n=64), [40]),
    "prefill_default": (None, [17, 130]),
    # I split over programs (3 chunks at I = 300 -> runs of 1; 2 at 129 -> 2 runs), f32 partials summed
    "prefill_split3": (PrefillConfig(block_m=16, block_n=32, split_k=3), [3, 40]),
    # bf16 x as one scaled f16 piece per row (f32 x, alternated in, ignores the flag), unsplit and split
    "prefill_x_f16_scaled": (PrefillConfig(block_m=16, block_n=32, x_f16_scaled=True), [3, 40]),
    "prefill_x_f16_scaled_split2": (PrefillConfig(block_m=32, block_n=64, split_k=2, x_f16_scaled=True), [40]),
}
EXACT_DTYPES = [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)]  # (x, out), alternated


# in CI: the tiles the default heuristics choose (decode at 1-16 rows, the x_f16 pieces and the scaled
# piece, a batched verify's rows, the GEMM, split or not, with the scaled piece) and uneven chunk runs;
# the other tiles are `slow` (CI time; `make test-all` and the GPU sweeps run them)
CI_CONFIGS = {"decode_default", "decode_split3_bo16", "decode_dot_verify_rows", "decode_dot_x_f16",
              "decode_dot_x_f16_scaled", "prefill_default", "prefill_split3", "prefill_x_f16_scaled"}


@pytest.mark.parametrize("name", slow_except(CONFIGS, CI_CONFIGS))
def test_kernel_exact_on_integer_problems(name):
    """Bit-exact against the float64 formula (exact in f32, then one rounding to the output dtype) on
    ragged shapes for every config: a masked lane that leaked anything, a chunk summed twice or a
    wrong scale would change the result."""
    config, rows = CONFIGS[name]
    rng = np.random.default_rng(len(name))
    for k, (m, (o, i)) in enumerate(itertools.product(rows, [(272, 300), (130, 129)])):
        x_dtype, out_dtype = EXACT_DTYPES[k % 2]
        x, wq, scale = exact_problem(rng, m, o, i)
        got = run_kernel(x, wq, scale, x_dtype, out_dtype, config)
        assert np.all(np.isfinite(got)), f"{name} m={m} o={o} i={i}: non-finite (unmasked read?)"
        want = np.asarray(jnp.asarray(f64_formula(x, wq, scale), jnp.float32).astype(out_dtype).astype(jnp.float32))
        np.testing.assert_array_equal(got, want, err_msg=f"{name} m={m} o={o} i={i}")


@pytest.mark.parametrize("x_scale", [2.0 ** -12, 2.0 ** 10])
def test_x_f16_pieces_exact_at_small_and_large_x(x_scale):
    """DecodeConfig(x_f16=True) with bf16 x whose values need the lo piece (multiples of 2^-12: x / 2^16
    falls off the f16 grid) or only the hi piece (up to 2^12): bit-exact against the float64 formula,
    and the pieces reconstruct x exactly."""
    rng = np.random.default_rng(int(np.log2(x_scale)) + 40)
    config = DecodeConfig(split_k=2, x_f16=True)
    for m, (o, i) in [(1, (272, 300)), (3, (130, 129))]:
        x, wq, scale = exact_problem(rng, m, o, i)
        x = x * x_scale  # exact: integers times a power of two, |x| <= 4 x_scale
        pieces = np.asarray(fp8_kernels._f16_pieces(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32), np.float64)
        np.testing.assert_array_equal(pieces[0] * fp8_kernels.X_F16_HI + pieces[1], x)
        if x_scale < 1:
            assert np.any(pieces[1] != 0), "the lo piece was not exercised"
        got = run_kernel(x, wq, scale, jnp.bfloat16, jnp.float32, config)
        np.testing.assert_array_equal(got, np.asarray(f64_formula(x, wq, scale), np.float32), err_msg=f"m={m}")


def test_x_f16_pieces_never_read_back_a_narrowing_convert():
    """XLA on the GPU may skip the rounding of an f32 -> f16 -> f32 round trip (excess precision, on
    by default); lo computed from such a read-back came out 0 on the H200 and the 27B-shape products
    lost ~1e-3. The CPU compiler keeps the rounding, so the exactness tests here cannot see it: the
    split must be built from f32 arithmetic whose f16 results are only ever outputs."""
    jaxpr = jax.make_jaxpr(fp8_kernels._f16_pieces)(jnp.zeros((2, 256), jnp.bfloat16)).jaxpr
    f16_vars = {v for eqn in jaxpr.eqns if eqn.primitive.name == "convert_element_type"
                for v in eqn.outvars if v.aval.dtype == jnp.float16}
    readers = [eqn.primitive.name for eqn in jaxpr.eqns if eqn.primitive.name != "concatenate"
               and eqn.primitive.name != "stack" and any(v in f16_vars for v in eqn.invars
                                                          if isinstance(v, jax.extend.core.Var))]
    assert len(f16_vars) == 2 and not readers, f"the f16 pieces are read back by {readers}"


def test_x_f16_pieces_limits():
    """The documented limits of the f16 pieces: below 2^-17 lo rounds to the 2^-24 grid (error <= 2^-25);
    at 2^32 hi overflows (the reconstruction, like the dot, is not finite)."""
    x = jnp.asarray([2.0 ** -17, 3 * 2.0 ** -20, 1.5 * 2.0 ** -24, -(2.0 ** 31) * 1.5, 2.0 ** 32], jnp.bfloat16)
    hi, lo = (np.asarray(p.astype(jnp.float32), np.float64) for p in fp8_kernels._f16_pieces(x[None])[:, 0])
    back = hi * fp8_kernels.X_F16_HI + lo
    want = np.asarray(x.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(back[[0, 1, 3]], want[[0, 1, 3]])
    assert abs(back[2] - want[2]) <= 2.0 ** -25 and not np.isfinite(back[4])  # inf - inf


@pytest.mark.parametrize("x_scale", [2.0 ** -30, 2.0 ** -12, 2.0 ** 10, 2.0 ** 40])
def test_x_f16_scaled_exact_at_small_and_large_x(x_scale):
    """DecodeConfig(x_f16_scaled=True) and the GEMM's PrefillConfig(x_f16_scaled=True): rows far below 1 (where the two pieces' lo rounds) and above
    the two pieces' 2^32 limit are bit-exact against the float64 formula (the row scale is a power of
    two and the f16 piece holds bf16's 8 bits; the rows' spans are test_x_f16_scaled_piece_limits')."""
    rng = np.random.default_rng(int(np.log2(x_scale)) + 80)
    config = DecodeConfig(split_k=2, x_f16=True, x_f16_scaled=True)
    gemm = PrefillConfig(block_m=16, block_n=32, split_k=2, x_f16_scaled=True)  # the GEMM's form of it
    for m, (o, i), config in [(1, (272, 300), config), (9, (130, 129), config), (40, (272, 300), gemm)]:
        x, wq, scale = exact_problem(rng, m, o, i)
        x = x * x_scale  # exact: integers times a power of two
        got = run_kernel(x, wq, scale, jnp.bfloat16, jnp.float32, config)
        want = np.asarray(f64_formula(x, wq, scale), np.float32)
        np.testing.assert_array_equal(got, want, err_msg=f"x_scale={x_scale} m={m}")


def test_x_f16_scaled_piece_limits():
    """The documented limits of the scaled piece: exact down to 2^-32 of the row's largest value; below,
    an error of at most 2^-39 of it; zero rows stay zero with a finite scale; inf and NaN propagate."""
    x = np.zeros((4, 256), np.float32)
    # largest in [2^14, 2^15), smallest 2^-17 with all 8 bits (its last at 2^-24, f16's subnormal grid)
    x[0, :4] = [2.0 ** 14 * 1.5, -(2.0 ** -18) * 1.5, 2.0 ** -17 * 1.25, 2.0 ** -17 * (1 + 2.0 ** -7)]
    x[1, :2] = [1.0, 2.0 ** -40 * 1.5]  # a value below 2^-32 of the largest
    x[3, :2] = [np.inf, 1.0]
    piece, row_scale = fp8_kernels._f16_scaled(jnp.asarray(x, jnp.bfloat16))
    back = np.asarray(piece.astype(jnp.float32), np.float64) * np.asarray(row_scale, np.float64)
    want = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(back[0], want[0])
    assert back[1, 0] == 1.0 and abs(back[1, 1] - want[1, 1]) <= 2.0 ** -39
    assert np.all(back[2] == 0) and np.all(np.isfinite(np.asarray(row_scale)))
    assert np.isinf(back[3, 0]) and back[3, 1] == 1.0
    assert piece.dtype == jnp.float16 and row_scale.shape == (4, 1)


def test_x_f16_scaled_is_a_form_of_x_f16():
    rng = np.random.default_rng(0)
    x, wq, scale = exact_problem(rng, 1, 130, 129)
    with pytest.raises(ValueError, match=r"x_f16_scaled=True\) is a form of x_f16"):
        run_kernel(x, wq, scale, jnp.bfloat16, jnp.float32, DecodeConfig(x_f16_scaled=True))


MANY_CONFIGS = {  # name: (config, rows)
    "default": (None, [1, 4, 16]),
    "x_f16": (DecodeConfig(split_k=2, x_f16=True), [1, 4]),
    "bo32_split3": (DecodeConfig(block_o=32, split_k=3), [5]),
    "prefill": (PrefillConfig(block_m=16, block_n=32), [3, 40]),
}


@pytest.mark.parametrize("name", slow_except(MANY_CONFIGS, {"default", "x_f16"}))  # the rest `slow` (CI time)
def test_many_weights_in_one_launch_exact(name):
    """Three weights of different ragged heights behind one x (as q/k/v or gate/up are): each output
    is bit-exact against its own float64 formula, so a program that served the wrong weight, read
    across a weight boundary or wrote into a neighbour's output would show."""
    config, rows = MANY_CONFIGS[name]
    rng = np.random.default_rng(11)
    for m in rows:
        x, w0, s0 = exact_problem(rng, m, 130, 300)
        ws, ss = [w0], [s0]
        for o in (16, 272):
            _, w, s = exact_problem(rng, m, o, 300)
            ws.append(w)
            ss.append(s)
        got = jax.jit(lambda x, ws, ss: fm.fp8_matmul_many(x, ws, ss, jnp.float32, interpret=True, config=config))(
            jnp.asarray(x, jnp.bfloat16), tuple(map(jnp.asarray, ws)), tuple(map(jnp.asarray, ss)))
        for j, (y, w, s) in enumerate(zip(got, ws, ss)):
            assert y.shape == (m, w.shape[0])
            np.testing.assert_array_equal(np.asarray(y), f64_formula(x, w, s), err_msg=f"{name} m={m} weight {j}")


# ------------------------------------------------------------------------------------------------
# the tiled weight layout (fp8_matmul.tile_weight): each [64, 128] chunk one contiguous run
# ------------------------------------------------------------------------------------------------


def test_tile_weight_layout_by_hand():
    """Element (o, i) of w lands at [o // 64, i // 128, o % 64, i % 128] in 64-row tiles; untile_weight
    inverts it; the default tile is fp8_layout.TILE_ROWS = 128 rows."""
    w = np.arange(128 * 256, dtype=np.float32).reshape(128, 256)
    assert fp8_layout.tile_weight(jnp.asarray(w)).shape == (1, 2, 128, 128)
    t = np.asarray(fp8_layout.tile_weight(jnp.asarray(w), 64))
    assert t.shape == (2, 2, 64, 128)
    for o, i in [(0, 0), (63, 127), (64, 128), (70, 3), (127, 255), (5, 200)]:
        assert t[o // 64, i // 128, o % 64, i % 128] == w[o, i]
    np.testing.assert_array_equal(np.asarray(fp8_layout.untile_weight(jnp.asarray(t))), w)
    assert fp8_layout.weight_shape(jnp.asarray(t)) == (128, 256)
    with pytest.raises(ValueError, match=r"tile_weight: w \(130, 256\) needs O a multiple of 64 and I of 128"):
        fp8_layout.tile_weight(jnp.zeros((130, 256), jnp.float8_e4m3fn), 64)


@pytest.mark.parametrize("m", slow_except([1, 4, 16], {1}))  # 4 / 16 `slow` (~10 s each)
def test_tiled_weights_give_the_same_bits(m):
    """The kernel on tiled weights equals the kernel on the checkpoint layout bit for bit (the same
    chunks in the same order), and both equal the float64 formula on an exact problem; two weights in
    one launch (q/k/v style), and the ref and the prefill path take the tiled layout too."""
    rng = np.random.default_rng(m)
    x, w0, s0 = exact_problem(rng, m, 256, 384)
    _, w1, s1 = exact_problem(rng, m, 128, 384)
    xj = jnp.asarray(x, jnp.bfloat16)
    ws, ss = (jnp.asarray(w0), jnp.asarray(w1)), (jnp.asarray(s0), jnp.asarray(s1))
    tiled = tuple(fp8_layout.tile_weight(w) for w in ws)
    many = jax.jit(lambda x, ws, ss: fm.fp8_matmul_many(x, ws, ss, jnp.float32, interpret=True))
    plain, got = many(xj, ws, ss), many(xj, tiled, ss)
    for j, (a, b, w, s) in enumerate(zip(plain, got, ws, ss)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"m={m} weight {j}")
        np.testing.assert_array_equal(np.asarray(b), f64_formula(x, np.asarray(w), np.asarray(s)))
    np.testing.assert_array_equal(np.asarray(fm.fp8_matmul_ref(xj, tiled[0], ss[0], jnp.float32)),
                                  f64_formula(x, w0, s0))
    for bn in (128, 64, 32):  # the GEMM reads a tile in two pieces, whole, or a half of it per program
        pre = fm.fp8_matmul(xj, tiled[0], ss[0], jnp.float32, interpret=True,
                            config=PrefillConfig(block_m=16, block_n=bn))
        np.testing.assert_array_equal(np.asarray(pre), f64_formula(x, w0, s0), err_msg=f"prefill block_n={bn}")
    np.testing.assert_array_equal(np.asarray(fm.fp8_matmul_dequant_dot(xj.astype(jnp.float32), tiled[1], ss[1],
                                                                       jnp.float32, interpret=True)), f64_formula(x, w1, s1))
    # E4M3 activations: the tiled weights give the checkpoint layout's bits
    a8 = jax.jit(lambda x, ws, ss: fm.fp8_matmul_many(x, ws, ss, jnp.float32, interpret=True, act_quant=True))
    for a, b in zip(a8(xj, ws, ss), a8(xj, tiled, ss)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"act_quant m={m}")
    # one tiled and one checkpoint-layout weight in one launch
    for y, w, s in zip(many(xj, (tiled[0], ws[1]), ss), (w0, w1), (s0, s1)):
        np.testing.assert_array_equal(np.asarray(y), f64_formula(x, w, s), err_msg=f"mixed m={m}")


def test_tiled_weights_read_whole_or_sliced_or_untiled():
    """A decode program of fewer rows than a tile reads its slice of the tile (one contiguous run); one
    of more rows than a tile gets the checkpoint layout (untiled), as does a GEMM program that would run
    past the last tile's rows."""
    rng = np.random.default_rng(0)
    x, w, s = exact_problem(rng, 2, 256, 384)
    t = fp8_layout.tile_weight(jnp.asarray(w), 64)
    got = fm.fp8_matmul(jnp.asarray(x, jnp.bfloat16), t, jnp.asarray(s), jnp.float32, interpret=True,
                        config=DecodeConfig(block_o=32, x_f16=True))
    np.testing.assert_array_equal(np.asarray(got), f64_formula(x, w, s))
    assert fm._fit_tiles((t,), DecodeConfig(block_o=32, x_f16=True))[0] is t  # read in place
    # 128-row programs on 64-row tiles: the checkpoint layout (untiled)
    got = fm.fp8_matmul(jnp.asarray(x, jnp.bfloat16), t, jnp.asarray(s), jnp.float32, interpret=True,
                        config=DecodeConfig(block_o=128, x_f16=True))
    np.testing.assert_array_equal(np.asarray(got), f64_formula(x, w, s))
    assert fm._fit_tiles((t,), DecodeConfig(block_o=128))[0].shape == (256, 384)
    # the GEMM joins 64-row tiles into its 128-row blocks, but 3 tiles are no whole number of them
    # (interpret mode pads a read past the last tile, so the rule itself is checked: on the GPU such a
    # program would read past the weight's end)
    _, w3, s3 = exact_problem(rng, 2, 192, 384)
    three, four = fm._fit_tiles((fp8_layout.tile_weight(jnp.asarray(w3), 64), t), PrefillConfig(block_n=128))
    assert three.shape == (192, 384) and four.shape == t.shape == (4, 3, 64, 128)


@pytest.mark.parametrize("m, config", [
    (1, None),  # the default config: 64-row programs, each reading half of a 128-row tile
    pytest.param(5, DecodeConfig(block_o=128, split_k=2, x_f16=True), marks=pytest.mark.slow),  # whole tiles, two pieces
    pytest.param(16, DecodeConfig(block_o=128, split_k=3, swap_ab=False, x_f16=True, x_f16_scaled=True),
                 marks=pytest.mark.slow),  # (5 and 16 rows `slow`: ~5 s each)
    (40, None),  # a batched verify's default (64-row programs)
    (64, DecodeConfig(block_o=128, split_k=2, x_f16=True, x_f16_scaled=True, num_warps=8)),
    (128, DecodeConfig(block_o=128, split_k=2, x_f16=True, x_f16_scaled=True, num_warps=8, num_stages=2)),  # tall
])
def test_128_row_tiles_give_the_same_bits(m, config):
    """128-row tiles: decode programs of 64 rows read half a tile, of 128 rows a whole one; the
    result equals the checkpoint layout's bit for bit and the float64 formula (and E4M3 activations
    read the tiles the same way)."""
    rng = np.random.default_rng(m + 7)
    x, w, s = exact_problem(rng, m, 384, 640)
    xj = jnp.asarray(x, jnp.bfloat16)
    tiled = fp8_layout.tile_weight(jnp.asarray(w), 128)
    assert tiled.shape == (3, 5, 128, 128)
    got = fm.fp8_matmul(xj, tiled, jnp.asarray(s), jnp.float32, interpret=True, config=config)
    want = fm.fp8_matmul(xj, jnp.asarray(w), jnp.asarray(s), jnp.float32, interpret=True, config=config)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), f64_formula(x, w, s))
    if m <= 16:
        quant = [fm.fp8_matmul_many(xj, (ww,), (jnp.asarray(s),), jnp.float32, interpret=True, act_quant=True)[0]
                 for ww in (tiled, jnp.asarray(w))]
        np.testing.assert_array_equal(np.asarray(quant[0]), np.asarray(quant[1]))
    if m == 40:  # the GEMM reads a whole tile or a half of it per program
        for bn in (128, 64):
            pre = fm.fp8_matmul(xj, tiled, jnp.asarray(s), jnp.float32, interpret=True,
                                config=PrefillConfig(block_m=16, block_n=bn))
            np.testing.assert_array_equal(np.asarray(pre), f64_formula(x, w, s), err_msg=f"prefill block_n={bn}")


def test_wide_launch_takes_its_tiles_rows_at_verify_rows(monkeypatch):
    """A launch's default config sees its weights' tile rows (fp8_matmul.tile_rows): at 40 verify rows
    a wide launch on 128-row tiles runs 128-row programs with 8 warps (fp8_config.VERIFY_WIDE_BLOCK_O),
    on 64-row tiles, a mix of both heights or the checkpoint layout 64-row ones; each bit for bit the
    float64 formula."""
    monkeypatch.setattr(fc, "SM_COUNT", 4)  # 384 rows are 6 blocks of 64: a wide launch on 4 SMs
    chosen, check = [], fc.check_config
    monkeypatch.setattr(fc, "check_config", lambda config, m: (chosen.append(config), check(config, m))[1])
    rng = np.random.default_rng(40)
    x, w, s = exact_problem(rng, 40, 384, 640)
    _, w2, s2 = exact_problem(rng, 40, 256, 640)
    xj, wj = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w)
    for ws, block_o in [((fp8_layout.tile_weight(wj, 128), fp8_layout.tile_weight(jnp.asarray(w2), 128)), 128),
                        ((fp8_layout.tile_weight(wj, 64), fp8_layout.tile_weight(jnp.asarray(w2), 64)), 64),
                        ((fp8_layout.tile_weight(wj, 128), fp8_layout.tile_weight(jnp.asarray(w2), 64)), 64),
                        ((wj, fp8_layout.tile_weight(jnp.asarray(w2), 128)), 64)]:
        got = fm.fp8_matmul_many(xj, ws, (jnp.asarray(s), jnp.asarray(s2)), jnp.float32, interpret=True)
        assert (chosen[-1].block_o, chosen[-1].num_warps) == (block_o, 8 if block_o == 128 else 4), [t.shape for t in ws]
        np.testing.assert_array_equal(np.asarray(got[0]), f64_formula(x, w, s))
        np.testing.assert_array_equal(np.asarray(got[1]), f64_formula(x, w2, s2))


def test_sliced_tiles_lower_for_h200():
    """o_proj's shape on 128-row tiles with the default 64-row programs (1 and 40 rows): one unmasked
    E4M3 load of a [64, 128] slice per chunk, no reshape."""
    sds = jax.ShapeDtypeStruct
    o, i = 5120, 6144
    for m in (1, 40):
        config = fc.default_config(m, o, i)
        args = (sds((m, i), jnp.bfloat16), sds((o // 128, i // 128, 128, 128), jnp.float8_e4m3fn),
                sds((o // 128, i // 128), jnp.float32))
        [(cfg, ir_text)] = triton_calls(lower_for_h200(
            lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16, config=config), args))
        assert (attr_int(cfg, "grid_x"), attr_int(cfg, "grid_y")) == (o // 64, config.split_k), m
        w_loads = [ln for ln in ir_text.splitlines() if "tt.load" in ln and "f8E4M3FN" in ln]
        assert len(w_loads) == 1 and w_loads[0].count("%") == 2 and "64x128x!tt.ptr<f8E4M3FN>" in w_loads[0], (m, w_loads)
        assert "tt.reshape" not in ir_text.split("scf.for")[1], m


def test_tiled_weights_lower_for_h200():
    """o_proj's shape on tiled weights: one Triton call on the same grid, one unmasked E4M3 load per chunk."""
    sds = jax.ShapeDtypeStruct
    o, i = 5120, 6144
    args = (sds((1, i), jnp.bfloat16), sds((o // 64, i // 128, 64, 128), jnp.float8_e4m3fn),
            sds((o // 128, i // 128), jnp.float32))
    lowered = lower_for_h200(lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16), args)
    [(cfg, ir_text)] = triton_calls(lowered)
    config = fc.default_config(1, o, i)
    assert (attr_int(cfg, "grid_x"), attr_int(cfg, "grid_y")) == (o // 64, config.split_k)
    assert attr_int(cfg, "num_stages") == config.num_stages and "scf.for" in ir_text
    w_loads = [ln for ln in ir_text.splitlines() if "tt.load" in ln and "f8E4M3FN" in ln]
    assert len(w_loads) == 1 and w_loads[0].count("%") == 2  # unmasked: vectorized loads
    # the GEMM (136 rows): its 128-row weight block is two 64-row tiles joined, one dot per chunk
    args = (sds((136, i), jnp.bfloat16),) + args[1:]
    [(cfg, ir_text)] = triton_calls(lower_for_h200(lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16), args))
    assert fc.default_config(136, o, i).block_n == 128 and attr_int(cfg, "grid_y") == o // 128
    assert ir_text.count("tt.dot ") == 1 and "tt.reshape" in ir_text


def test_many_rejects_mismatched_inputs():
    rng = np.random.default_rng(0)
    x, wq, scale = exact_problem(rng, 2, 130, 129)
    with pytest.raises(ValueError, match=r"2 weights and 1 scale grids"):
        fm.fp8_matmul_many(jnp.asarray(x, jnp.bfloat16), (jnp.asarray(wq),) * 2, (jnp.asarray(scale),), interpret=True)
    with pytest.raises(ValueError, match=r"x \(2, 129\) and w \(130, 64\)"):
        fm.fp8_matmul_many(jnp.asarray(x, jnp.bfloat16), (jnp.asarray(wq), jnp.zeros((130, 64), jnp.float8_e4m3fn)),
                           (jnp.asarray(scale), jnp.ones((2, 1), jnp.float32)), interpret=True)


def test_f32_activations_keep_f32_precision():
    """x values that bf16 cannot hold (24-bit mantissas): the three-piece split must reproduce the f32
    result; rounding x to bf16 instead would be off by ~2^-9 relative, far above the tolerance."""
    rng = np.random.default_rng(5)
    for m, config in [(1, None), (4, None), (1, DecodeConfig()), (4, DecodeConfig(swap_ab=False)), (40, None)]:
        x, wq, scale = random_problem(rng, m, 130, 300, jnp.float32)
        x = x * (1.0 + 2.0**-12)  # push mantissa bits beyond bf16
        got = run_kernel(x, wq, scale, jnp.float32, jnp.float32, config)
        assert_close(got, f64_formula(x, wq, scale), f32_accum_tol(300), f"f32 x m={m}")
        as_bf16 = f64_formula(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)), wq, scale)
        assert np.max(np.abs(as_bf16 - f64_formula(x, wq, scale))) > 10 * f32_accum_tol(300) * np.abs(as_bf16).max()


def test_leading_dims_and_empty_inputs():
    rng = np.random.default_rng(3)
    for lead in [(2, 3), (1, 1, 1), (3, 7)]:  # 6 and 1 rows: decode; 21 rows: prefill
        x, wq, scale = random_problem(rng, 0, 130, 129, jnp.bfloat16, lead=lead)
        got = run_kernel(x, wq, scale, jnp.bfloat16, jnp.float32)
        assert got.shape == (*lead, 130)
        assert_close(got, run_ref(x, wq, scale, jnp.bfloat16, jnp.float32), f32_accum_tol(129), f"lead {lead}")
    _, wq, scale = random_problem(rng, 1, 130, 129, jnp.bfloat16)
    y = fm.fp8_matmul(jnp.zeros((0, 129), jnp.bfloat16), jnp.asarray(wq), jnp.asarray(scale), interpret=True)
    assert y.shape == (0, 130) and y.dtype == jnp.bfloat16


def test_interpret_mode_poisons_out_of_bounds():
    """The poison the NaN checks rely on: interpret mode reads NaN past an array's end (f32 and
    E4M3) and leaves unstored output NaN. If a JAX upgrade changed this, the ragged tests above
    could no longer see a missing mask, so this test fails first."""

    def kernel(x_ref, w_ref, o_ref):
        start = pl.program_id(0) * 8  # dynamic, like the kernel's tile offsets
        x = plgpu.load(x_ref.at[pl.ds(start, 8)])
        w = plgpu.load(w_ref.at[pl.ds(start, 8)]).astype(jnp.float32)
        plgpu.store(o_ref.at[pl.ds(start, 8)], x + w, mask=jnp.arange(8) < 6)

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), grid=(1,), interpret=True)(
        jnp.ones((5,), jnp.float32), jnp.ones((5,), jnp.float8_e4m3fn))
    out = np.asarray(out)
    np.testing.assert_array_equal(out[:5], 2.0)
    assert np.all(np.isnan(out[5:])), out


def test_default_config_heuristic():
    dc, pc = fc.default_config, fc.prefill_config
    assert dc(32, 130, 129).split_k == 1 and dc(5, 130, 129).split_k == 1  # two chunks: nothing to split
    # every launch of <= 128 rows streams on the decode grid (wide ones too), more rows run the GEMM
    for o in (17408, 2 * 17408, 5120):
        assert isinstance(dc(128, o, 5120), DecodeConfig) and isinstance(dc(129, o, 5120), PrefillConfig), o
    ns = fc.NARROW_NUM_STAGES
    # 1-8 rows: two f16 pieces per row on the dot's M side, preloaded scales; wide: split-K 2
    assert dc(1, 17408, 5120) == dc(5, 17408, 5120) == DecodeConfig(block_o=64, split_k=2, swap_ab=False,
                                                                     scale_preload=True, x_f16=True)
    assert [dc(1, o, 5120).split_k for o in (17408, 12288, 10240)] == [2, 2, 2]
    # narrow (80 row blocks): split-K 8 -> 640 programs on 132 SMs (NARROW_PROGRAMS_PER_SM), 3 stages
    assert dc(1, 5120, 17408) == DecodeConfig(block_o=64, split_k=8, swap_ab=False, scale_preload=True, x_f16=True,
                                              num_stages=ns)
    for m in (1, 5, 8, 16):
        assert [dc(m, o, i).split_k for o, i in ((5120, 17408), (5120, 6144), (6144, 5120))] == [8] * 3
    assert dc(1, 5120, 3072).split_k == 4  # 24 chunks (o_proj at TP2): each split keeps >= 4
    assert dc(1, 1024, 5120).split_k == 8  # k/v projections: 16 row blocks
    # 9-16 rows: one scaled f16 piece per row
    assert not dc(8, 17408, 5120).x_f16_scaled and dc(9, 17408, 5120).x_f16_scaled
    assert dc(16, 17408, 5120) == DecodeConfig(block_o=64, split_k=2, swap_ab=False, scale_preload=True, x_f16=True,
                                               x_f16_scaled=True)
    assert dc(16, 5120, 17408) == DecodeConfig(block_o=64, split_k=8, swap_ab=False, scale_preload=True, x_f16=True,
                                               x_f16_scaled=True, num_stages=ns)
    # a batched verify of 17-32 rows: split-K 4, W on the dot's M side, scales loaded per chunk
    for m in (17, 32):
        for o, i in ((17408, 5120), (5120, 17408)):
            assert dc(m, o, i) == DecodeConfig(block_o=64, split_k=4, x_f16=True, x_f16_scaled=True), (m, o)
    # 33-128 rows: VERIFY_STAGES, split-K 8 where runs keep >= 16 chunks (mlp_down's 136), 4 otherwise
    for m in (33, 64, 65, 128):
        assert dc(m, 5120, 6144) == DecodeConfig(block_o=64, split_k=4, x_f16=True, x_f16_scaled=True,
                                                 num_stages=fc.VERIFY_STAGES), m
        assert dc(m, 5120, 17408).split_k == 8 and dc(m, 2 * 17408, 5120).split_k == 4, m
    # 128-row programs (8 warps) for a wide launch at 33-64 rows on tiles of a multiple of 128 rows
    for m, o, tile_rows, block_o in [(40, 2 * 17408, 128, 128), (64, 2 * 17408, 128, 128), (40, 2 * 17408, 64, 64),
                                     (40, 2 * 17408, None, 64), (65, 2 * 17408, 128, 64), (40, 5120, 128, 64)]:
        c = dc(m, o, 5120, tile_rows=tile_rows)
        assert (c.block_o, c.num_warps) == (block_o, 8 if block_o == 128 else 4), (m, o, tile_rows)
    # the GEMM: one scaled f16 piece per row; split along I while its grid has fewer than 132 programs
    assert dc(512, 17408, 5120) == PrefillConfig(block_m=128, block_n=128, num_warps=8, x_f16_scaled=True)
    assert pc(129, 17408, 5120) == PrefillConfig(block_m=64, block_n=128, x_f16_scaled=True)
    assert pc(64, 5120, 6144).split_k == 4  # o_proj: 40 tiles -> 160 programs
    assert pc(64, 1024, 5120).split_k == 8  # k_proj: 8 tiles, 40 chunks -> runs of 5
    assert pc(64, 17408, 5120).split_k == 1  # gate: 136 tiles
    assert pc(512, 5120, 6144).split_k == 1  # 4 x 40 tiles
    assert pc(40, 5120, 17408).split_k == 4
    assert pc(64, 5120, 384).split_k == 1  # 3 chunks: no run of 4 to split
    assert pc(4096, 1024, 5120).split_k == 1
    # E4M3 activations: the decode grid with W on the dot's M side, x as it is, 4 stages
    for m in (1, 16, 32):
        c = fc.act_quant_config(m, 5120, 6144)
        assert c.swap_ab and not c.x_f16 and not c.x_f16_scaled and c.num_stages == 4, (m, c)
        assert c.split_k == fc.decode_config(m, 5120, 6144).split_k


def _bad(**kw):
    rng = np.random.default_rng(0)
    x, wq, scale = exact_problem(rng, 3, 130, 129)
    args = dict(x=jnp.asarray(x, jnp.bfloat16), w=jnp.asarray(wq), scale=jnp.asarray(scale), out_dtype=None,
                config=None)
    args.update(kw)
    fm.fp8_matmul(args["x"], args["w"], args["scale"], args["out_dtype"], interpret=True, config=args["config"])


@pytest.mark.parametrize("kw,match", [
    (dict(w=jnp.zeros((130, 128), jnp.float8_e4m3fn)), r"x \(3, 129\) and w \(130, 128\)"),
    (dict(scale=jnp.ones((2, 1), jnp.float32)), r"scale \(2, 1\) is not the 128x128 grid \(2, 2\)"),
    (dict(w=jnp.zeros((130, 129), jnp.bfloat16)), r"float8_e4m3fn needed"),
    (dict(x=jnp.zeros((3, 129), jnp.int32)), r"bfloat16 or float32 needed"),
    (dict(out_dtype=jnp.int8), r"out_dtype int8"),
    (dict(config=DecodeConfig(block_o=48)), r"block_o=48 must be a power of two in \[16, 128\]"),
    (dict(config=DecodeConfig(block_o=256)), r"block_o=256"),
    (dict(config=DecodeConfig(split_k=0)), r"split_k=0"),
    (dict(x=jnp.zeros((65, 129), jnp.bfloat16), config=DecodeConfig(x_f16=True)),
     r"x_f16=True\) is for M <= 64 rows \(two f16 pieces per row; x_f16_scaled takes 128\), got M=65"),
    (dict(config=PrefillConfig(split_k=0)), r"PrefillConfig.split_k=0"),
    (dict(config=PrefillConfig(block_m=8)), r"block_m=8 must be a power of two >= 16"),
    (dict(config=PrefillConfig(block_n=256)), r"block_n=256"),
    (dict(config=PrefillConfig(num_warps=0)), r"num_warps and num_stages must be >= 1"),
    (dict(config="fast"), r"DecodeConfig or PrefillConfig"),
])
def test_wrapper_rejects_bad_inputs(kw, match):
    with pytest.raises(ValueError, match=match):
        _bad(**kw)


def test_wrapper_rejects_int32_offset_overflow():
    sds = jax.ShapeDtypeStruct  # shapes only: nothing is allocated
    with pytest.raises(ValueError, match=r"int32 offsets"):
        jax.eval_shape(lambda x, w, s: fm.fp8_matmul(x, w, s), sds((1, 65536), jnp.bfloat16),
                       sds((32768, 65536), jnp.float8_e4m3fn), sds((256, 512), jnp.float32))


def test_decode_config_rejects_many_rows():
    rng = np.random.default_rng(0)
    x, wq, scale = exact_problem(rng, 129, 130, 129)
    with pytest.raises(ValueError, match=r"DecodeConfig is for M <= 128 rows, got M=129"):
        fm.fp8_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(wq), jnp.asarray(scale), interpret=True,
                      config=DecodeConfig())


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_dequant_dot_is_exact_on_exact_problems(x_dtype):
    rng = np.random.default_rng(3)
    x, wq, scale = exact_problem(rng, 40, 300, 257)  # ragged O and I
    got = fm.fp8_matmul_dequant_dot(jnp.asarray(x, x_dtype), jnp.asarray(wq), jnp.asarray(scale),
                                    out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float64), f64_formula(x, wq, scale))


def test_dequant_dot_error_is_one_bf16_rounding_per_weight():
    """Random E4M3 weights times non-power-of-two scales: W rounds once to bf16 (relative 2^-9),
    so |y - y_f64| <= 2^-9 sum_i |x_i w_i| (+ the f32 accumulation's share)."""
    rng = np.random.default_rng(4)
    m, o, i = 20, 256, 384
    x = rng.standard_normal((m, i)).astype(np.float32).astype(jnp.bfloat16).astype(np.float32)
    wq = (rng.standard_normal((o, i)) * 4).astype(np.float32).astype(E4M3)
    scale = rng.uniform(0.01, 0.1, (2, 3)).astype(np.float32)
    got = np.asarray(fm.fp8_matmul_dequant_dot(jnp.asarray(x, jnp.bfloat16), jnp.asarray(wq), jnp.asarray(scale),
                                               out_dtype=jnp.float32, interpret=True), np.float64)
    want = f64_formula(x, wq, scale)
    w64 = np.asarray(fm.dequantize_ref(jnp.asarray(wq), jnp.asarray(scale)), np.float64)
    bound = 2.0**-9 * np.abs(x.astype(np.float64)) @ np.abs(w64).T * (1 + 1e-3) + 1e-6
    assert np.all(np.abs(got - want) <= bound)
    assert np.max(np.abs(got - want)) > 0  # the rounding is real: the check above is not vacuous


# ------------------------------------------------------------------------------------------------
# lowering for the H200 from the CPU (CI)
# ------------------------------------------------------------------------------------------------

E, F = 5120, 17408  # Qwen3.5-27B hidden and ffn sizes


LOWER_CASES = {  # name: (M, O, I, x dtype, expected grid, tt.dot count)
    "decode_m1_gate_up": (1, F, E, jnp.bfloat16, (F // 64, 2), 1),
    "decode_m5_gate_up": (5, F, E, jnp.bfloat16, (F // 64, 2), 1),
    # 16 rows in one scaled f16 piece each: the narrow x-on-M policy, split-K 8
    "decode_m16_down_splitk": (16, E, F, jnp.bfloat16, (E // 64, 8), 1),
    "decode_m32_down_verify": (32, E, F, jnp.bfloat16, (E // 64, 4), 1),  # a batched verify (8 x K+1)
    "decode_m64_gate_up": (64, F, E, jnp.bfloat16, (F // 64, 4), 1),  # a wide launch at 64 rows
    "decode_m4_f32_x": (4, F, E, jnp.float32, (F // 64, 2), 3),  # hi / mid / lo pieces
    "prefill_m512": (512, F, E, jnp.bfloat16, (4, F // 128), 1),
    "prefill_m40_down_f32_x": (40, E, F, jnp.float32, (1, E // 128), 3),  # split-K 4 (40 output tiles)
    "prefill_m64_down": (64, E, F, jnp.bfloat16, (1, E // 128), 1),  # the GEMM at 64 rows: split-K 4
    "verify_m48_down_default": (48, E, F, jnp.bfloat16, (E // 64, 8), 1),  # narrow: the decode grid, split 8
    "ragged_decode": (5, 130, 129, jnp.bfloat16, (3, 1), 1),
    "ragged_decode_f32_x": (1, 130, 129, jnp.float32, (3, 1), 3),
    "ragged_prefill": (40, 130, 129, jnp.bfloat16, (1, 2), 1),
}


@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_kernel_lowers_for_h200(name):
    m, o, i, x_dtype, grid, n_dots = LOWER_CASES[name]
    sds = jax.ShapeDtypeStruct
    args = (sds((m, i), x_dtype), sds((o, i), jnp.float8_e4m3fn), sds((-(-o // 128), -(-i // 128)), jnp.float32))
    if "prefill" in name:  # the GEMM, where the default takes the decode grid (<= DECODE_MAX_ROWS rows)
        config = fc.prefill_config(m, o, i)
    else:
        config = fc.default_config(m, o, i)
    lowered = lower_for_h200(lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16, config=config), args)
    [(cfg, ir_text)] = triton_calls(lowered)
    split = config.split_k if isinstance(config, PrefillConfig) else 1  # the GEMM's I splits are its grid's z
    assert tuple(attr_int(cfg, f"grid_{a}") for a in "xy") == grid and attr_int(cfg, "grid_z") == split
    assert attr_int(cfg, "num_warps") == config.num_warps and attr_int(cfg, "num_stages") == config.num_stages
    assert "scf.for" in ir_text, "the chunk loop is not an scf.for (Triton cannot pipeline it)"
    assert ir_text.count("tt.dot ") == n_dots
    assert "tt.fp_to_fp" in ir_text, "E4M3 -> bf16/f32 conversion"
    w_loads = [ln for ln in ir_text.splitlines() if "tt.load" in ln and "f8E4M3FN" in ln]
    assert len(w_loads) == 1
    aligned = o % 128 == 0 and i % 128 == 0
    # real shapes: the weight loads carry no mask (vectorized 16-byte loads); ragged ones are masked
    assert all((ld.count("%") == 2) == aligned for ld in w_loads), w_loads


def test_many_weights_lower_to_one_launch_for_h200():
    """q/k/v of a 27B attention layer at K+1 = 4 rows: one Triton call whose grid covers the three
    weights' row blocks, one guarded branch (scf.if) per weight."""
    sds = jax.ShapeDtypeStruct
    os = (12288, 1024, 1024)
    ws = tuple(sds((o, E), jnp.float8_e4m3fn) for o in os)
    ss = tuple(sds((o // 128, E // 128), jnp.float32) for o in os)
    lowered = lower_for_h200(lambda x, ws, ss: fm.fp8_matmul_many(x, ws, ss), (sds((4, E), jnp.bfloat16), ws, ss))
    [(cfg, ir_text)] = triton_calls(lowered)
    config = fc.default_config(4, sum(os), E)
    assert attr_int(cfg, "grid_x") == sum(os) // config.block_o
    assert ir_text.count("scf.if") >= 3
    assert len([ln for ln in ir_text.splitlines() if "tt.load" in ln and "f8E4M3FN" in ln]) == 3


# ------------------------------------------------------------------------------------------------
# on the GPU (deselected on the CPU):
#   JAX_PLATFORMS=cuda PYTHONPATH=. python -m pytest -q -m gpu tests/test_kernel_fp8_matmul.py
# ------------------------------------------------------------------------------------------------


def gpu_required():
    if jax.default_backend() != "gpu":
        pytest.fail(f"gpu test on backend {jax.default_backend()!r}: run with JAX_PLATFORMS=cuda")


@functools.lru_cache(maxsize=None)
def real_weights(o, i, kind):
    """Weights at real sizes, made once per test run (generating ~90M values costs seconds).
    kind "random": random_problem's block-graded gaussians; "exact": E4M3 integers |w| <= 16 with
    scales 1 .. 8 (with |x| <= 2 and I <= 17408 every sum is an integer below 2^22: exact in f32, also
    in the tensor cores' f32 accumulators, in any order)."""
    rng = np.random.default_rng(o * 3 + i)
    if kind == "random":
        _, wq, scale = random_problem(rng, 1, o, i, jnp.bfloat16)
        return wq, scale
    wq = rng.integers(-16, 17, (o, i), dtype=np.int8).astype(np.float32).astype(E4M3)
    return wq, (2.0 ** rng.integers(0, 4, (-(-o // 128), -(-i // 128)))).astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("o,i", [(F, E), (E, F)])  # gate/up and down projections of Qwen3.5-27B
def test_gpu_kernel_matches_ref_real_shapes(o, i):
    gpu_required()
    wq, scale = real_weights(o, i, "random")
    rng = np.random.default_rng(o)
    for m in (1, 4, 5, 16, 40, 512):
        x = np.asarray(jnp.asarray(rng.standard_normal((m, i)), jnp.bfloat16).astype(jnp.float32))
        for out_dtype in (jnp.float32, jnp.bfloat16):
            got = run_kernel(x, wq, scale, jnp.bfloat16, out_dtype, interpret=False)
            want = run_ref(x, wq, scale, jnp.bfloat16, out_dtype)
            assert_close(got, want, out_tol(i, out_dtype), f"gpu m={m} o={o} i={i} out={jnp.dtype(out_dtype).name}")
            if m <= 16:  # the same rows as f16 pieces (x_f16)
                cfg = dataclasses.replace(fc.decode_config(m, o, i), x_f16=True)
                got = run_kernel(x, wq, scale, jnp.bfloat16, out_dtype, cfg, interpret=False)
                assert_close(got, want, out_tol(i, out_dtype), f"gpu x_f16 m={m} o={o} i={i}")


@pytest.mark.gpu
def test_gpu_kernel_f32_activations():
    gpu_required()
    wq, scale = real_weights(F, E, "random")
    rng = np.random.default_rng(1)
    for m in (1, 5, 40):
        x = rng.standard_normal((m, E)).astype(np.float32)
        got = run_kernel(x, wq, scale, jnp.float32, jnp.float32, interpret=False)
        assert_close(got, f64_formula(x, wq, scale), f32_accum_tol(E), f"gpu f32 x m={m}")


GPU_CONFIGS = {  # name: (config, rows)
    "default": (None, [1, 5, 16, 40]),
    "decode_noswap": (DecodeConfig(swap_ab=False), [3, 16]),
    "decode_bo128_split2": (DecodeConfig(block_o=128, split_k=2), [5]),
    "decode_bo32_split4_w8": (DecodeConfig(block_o=32, split_k=4, num_warps=8), [16]),
    "decode_x_f16": (DecodeConfig(split_k=2, x_f16=True), [1, 4, 16]),
    "decode_x_f16_noswap_verify": (DecodeConfig(split_k=4, swap_ab=False, x_f16=True), [32]),
    # one scaled f16 piece per row (the default from 9 rows), 3 stages (the narrow default)
    "decode_x_f16_scaled": (DecodeConfig(split_k=8, swap_ab=False, x_f16=True, x_f16_scaled=True, num_stages=3),
                            [9, 16, 32]),
    "tiled_default": ("tiled", [1, 4, 16, 40, 64, 600]),  # the default configs on fp8_layout.tile_weight's tiles
    # 65-128 rows on the decode grid
    "decode_x_f16_scaled_tall": (DecodeConfig(split_k=4, swap_ab=True, x_f16=True, x_f16_scaled=True, num_stages=2),
                                 [65, 128]),
    "prefill_default": (PrefillConfig(), [1, 600]),
    "prefill_128x128_w8": (PrefillConfig(block_m=128, num_warps=8), [40, 600]),
    # the default GEMM of a batched verify: [5120, 17408] (and the ragged shape) split along I at 64 rows
    "gemm_default_verify_rows": (None, [33, 64, 256]),
    "gemm_split_verify_rows": (PrefillConfig(split_k=4), [33, 64]),
    "gemm_x_f16_scaled_verify_rows": (PrefillConfig(split_k=2, x_f16_scaled=True), [40, 600]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_kernel_exact_on_integer_problems(name):
    """Bit-exact against the ref at real and ragged sizes for each config on the device."""
    gpu_required()
    config, rows = GPU_CONFIGS[name]
    rng = np.random.default_rng(len(name))
    tiled = config == "tiled"
    for o, i in [(F, E), (E, F)] if tiled else [(F, E), (E, F), (F + 72, E + 40)]:
        wq, scale = real_weights(o, i, "exact")
        for m in rows:
            x = rng.integers(-2, 3, (m, i)).astype(np.float32)
            if tiled:
                got = np.asarray(fm.fp8_matmul(jnp.asarray(x, jnp.bfloat16), fp8_layout.tile_weight(jnp.asarray(wq)),
                                               jnp.asarray(scale), jnp.float32))
            else:
                got = run_kernel(x, wq, scale, jnp.bfloat16, jnp.float32, config, interpret=False)
            np.testing.assert_array_equal(got, run_ref(x, wq, scale, jnp.bfloat16, jnp.float32),
                                          err_msg=f"{name} m={m} o={o} i={i}")


@pytest.mark.gpu
def test_gpu_128_row_tiles_exact():
    """Weights in 128-row tiles on the device: the default configs (64-row programs
    reading halves of a tile) and 128-row programs reading whole tiles at decode and verify rows, bit-
    exact against the ref (o_proj's and mlp_down's shapes)."""
    gpu_required()
    rng = np.random.default_rng(12)
    for o, i in [(E, 6144), (E, F), (F, E)]:  # (F, E): a wide launch, 128-row programs by default at 40 / 64
        wq, scale = real_weights(o, i, "exact")
        tiled = fp8_layout.tile_weight(jnp.asarray(wq), 128)
        for m in (1, 4, 16, 40, 64):
            x = rng.integers(-2, 3, (m, i)).astype(np.float32)
            want = run_ref(x, wq, scale, jnp.bfloat16, jnp.float32)
            whole = dataclasses.replace(fc.default_config(m, o, i), block_o=128,
                                        num_warps=8 if m > 16 else 4)
            for config in (None, whole):
                got = fm.fp8_matmul(jnp.asarray(x, jnp.bfloat16), tiled, jnp.asarray(scale), jnp.float32,
                                    config=config)
                np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"m={m} o={o} i={i} {config}")


@pytest.mark.parametrize("m, o, i", [(1, F, E), (4, E, F)])
def test_scale_preload_lowers_for_h200(m, o, i):
    """DecodeConfig(scale_preload=True) (the bench sweeps it) compiles for the H200: one Triton call,
    the chunk loop still an scf.for."""
    sds = jax.ShapeDtypeStruct
    config = dataclasses.replace(fc.decode_config(m, o, i), scale_preload=True)
    args = (sds((m, i), jnp.bfloat16), sds((o, i), jnp.float8_e4m3fn), sds((o // 128, i // 128), jnp.float32))
    lowered = lower_for_h200(lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16, config=config), args)
    [(cfg, ir_text)] = triton_calls(lowered)
    assert attr_int(cfg, "grid_y") == config.split_k and "scf.for" in ir_text


@pytest.mark.parametrize("m, o, i", [(1, F, E), (4, E, F), (16, E, F)])
def test_x_f16_lowers_for_h200(m, o, i):
    """DecodeConfig(x_f16=True) compiles for the H200: one Triton call with one f16 dot per chunk
    over the rows [hi; lo] and the weight converted E4M3 -> f16, not bf16."""
    sds = jax.ShapeDtypeStruct
    config = dataclasses.replace(fc.decode_config(m, o, i), x_f16=True)
    args = (sds((m, i), jnp.bfloat16), sds((o, i), jnp.float8_e4m3fn), sds((o // 128, i // 128), jnp.float32))
    lowered = lower_for_h200(lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16, config=config), args)
    [(cfg, ir_text)] = triton_calls(lowered)
    assert ir_text.count("tt.dot ") == 1 and "scf.for" in ir_text
    converts = [ln for ln in ir_text.splitlines() if "tt.fp_to_fp" in ln and "f8E4M3FN" in ln]
    assert converts and all("xf16" in ln and "xbf16" not in ln for ln in converts), converts


def test_gemm_x_f16_scaled_lowers_for_h200():
    """The GEMM's default at a batched verify's 192 rows (48 slots at K=3, past the decode grid's 128)
    compiles for the H200: one f16 dot per chunk, x one f16 piece per row, the weight converted to f16
    (no bf16 dot)."""
    sds = jax.ShapeDtypeStruct
    m, o, i = 192, 17408, 5120
    config = fc.default_config(m, o, i)
    assert isinstance(config, PrefillConfig) and config.x_f16_scaled
    args = (sds((m, i), jnp.bfloat16), sds((o // 64, i // 128, 64, 128), jnp.float8_e4m3fn),
            sds((o // 128, i // 128), jnp.float32))  # on tiled weights, as the engine lays them out
    lowered = lower_for_h200(lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16, config=config), args)
    [(cfg, ir_text)] = triton_calls(lowered)
    assert ir_text.count("tt.dot ") == 1 and "scf.for" in ir_text
    assert f"tensor<{config.block_m}x128xf16>" in ir_text  # x: one f16 piece per row
    converts = [ln for ln in ir_text.splitlines() if "tt.fp_to_fp" in ln and "f8E4M3FN" in ln]
    assert converts and all("xf16" in ln and "xbf16" not in ln for ln in converts), converts
    assert [ln for ln in ir_text.splitlines() if "bf16" in ln and "tt.dot" in ln] == []
    assert attr_int(cfg, "grid_x") == m // config.block_m and attr_int(cfg, "grid_y") == o // config.block_n


def test_decode_grid_lowers_for_h200_at_128_rows():
    """gate's shape at a 128-row verify on the decode grid: one Triton call
    on O / 64 row blocks with 3 stages, one f16 dot per chunk over all 128 rows (x one [128, 128]
    f16 slice), the weight converted to f16."""
    sds = jax.ShapeDtypeStruct
    m, o, i = 128, F, E
    config = fc.default_config(m, o, i)
    assert isinstance(config, DecodeConfig) and config.num_stages == fc.VERIFY_STAGES and config.x_f16_scaled
    args = (sds((m, i), jnp.bfloat16), sds((o // 64, i // 128, 64, 128), jnp.float8_e4m3fn),
            sds((o // 128, i // 128), jnp.float32))
    [(cfg, ir_text)] = triton_calls(lower_for_h200(
        lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16, config=config), args))
    assert (attr_int(cfg, "grid_x"), attr_int(cfg, "grid_y")) == (o // 64, config.split_k)
    assert attr_int(cfg, "num_stages") == 3 and ir_text.count("tt.dot ") == 1 and "scf.for" in ir_text
    assert "tensor<128x128xf16>" in ir_text and "tensor<64x128xf16>" in ir_text  # x slice, converted W


@pytest.mark.parametrize("m, o, i", [(16, F, E), (16, E, F), (32, F, E)])
def test_x_f16_scaled_lowers_for_h200(m, o, i):
    """The default configs from 9 rows compile for the H200: one f16 dot per chunk over M rows (BM = 16
    at 16 rows, not the two pieces' 32), the weight converted to f16."""
    sds = jax.ShapeDtypeStruct
    config = fc.decode_config(m, o, i)
    assert config.x_f16 and config.x_f16_scaled
    args = (sds((m, i), jnp.bfloat16), sds((o, i), jnp.float8_e4m3fn), sds((o // 128, i // 128), jnp.float32))
    lowered = lower_for_h200(lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16, config=config), args)
    [(cfg, ir_text)] = triton_calls(lowered)
    assert ir_text.count("tt.dot ") == 1 and "scf.for" in ir_text
    assert f"tensor<{m}x128xf16>" in ir_text, "x rows are not one f16 piece each"
