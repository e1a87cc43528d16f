"""Row-invariant numerics: a row's result does not depend on how many rows share the launch.

Greedy MTP equals plain decoding in bfloat16 only if a token's numbers are the same bits whether it
is decoded alone (one row), as one of the K+1 rows of a verify pass, or as one row of a batch: a
near-tie otherwise flips between them. Each case computes row 0 alone and inside launches of 2..128
rows and requires identical bits (f32 outputs, so no final rounding can hide a different sum order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from h200_lowering import lower_for_h200, triton_calls

from pallas_kernels import fp8_config
from pallas_kernels import fp8_matmul as fm
from qmtp.model.fp8 import Fp8Block, quantize_np
from qmtp.runtime import ops
from qmtp.runtime.kernel_config import PALLAS, REF, KernelConfig

ROWS = (2, 3, 5, 8, 9, 17, 33, 64, 128)


def _row0_alone_and_in(fn, x, rows=ROWS) -> dict:
    """{m: row 0 of fn(x[:m])} for 1 and each m of rows, as f32 numpy."""
    f = jax.jit(fn)
    return {m: np.asarray(f(x[:m])[0].astype(jnp.float32)) for m in (1,) + rows}


def _parted(results: dict) -> list[int]:
    return [m for m in results if not np.array_equal(results[m], results[1])]


# bf16 weights: out rows <= ops.BF16_REDUCE_MAX_OUT take the reduce form under Pallas, wider ones the dot
@pytest.mark.parametrize("kernels", [REF, PALLAS], ids=["ref", "pallas"])
@pytest.mark.parametrize("out_features,in_features", [(8, 256), (256, 256), (768, 256), (1024, 512)])
def test_bf16_linear_row_alone_equals_row_in_a_launch(kernels, out_features, in_features):
    rng = np.random.default_rng(out_features)
    x = jnp.asarray(rng.standard_normal((128, in_features)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((out_features, in_features)) * 0.05, jnp.bfloat16)
    results = _row0_alone_and_in(lambda x: ops.linear(x, w, kernels, out_dtype=jnp.float32), x)
    assert _parted(results) == []


def test_fp8_linear_reference_row_alone_equals_row_in_a_launch():
    rng = np.random.default_rng(1)
    weight, scale = quantize_np(rng.standard_normal((384, 256)).astype(np.float32) * 0.05)
    w = Fp8Block(jnp.asarray(weight), jnp.asarray(scale))
    x = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)
    results = _row0_alone_and_in(lambda x: ops.linear(x, w, REF, out_dtype=jnp.float32), x)
    assert _parted(results) == []


def test_a_leading_batch_shape_keeps_the_row_alone_form():
    """[1, 1, I] (one sequence, one token, as decode calls it) is the same one row as [1, I]."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 256)) * 0.05, jnp.bfloat16)
    flat = ops.linear(x[:1], w, REF, out_dtype=jnp.float32)
    nested = ops.linear(x[:1].reshape(1, 1, 256), w, REF, out_dtype=jnp.float32)
    assert nested.shape == (1, 1, 512)
    np.testing.assert_array_equal(np.asarray(nested).reshape(1, 512), np.asarray(flat))
    np.testing.assert_array_equal(np.asarray(flat[0]), np.asarray(ops.linear(x, w, REF, out_dtype=jnp.float32)[0]))


# The Pallas block matmul (interpret mode here; `gpu` below on the H200): fp8_matmul's default configs
# change tiles and split-K with M (rows part from 9 on), row_invariant keeps one config per shape.
# Past DECODE_MAX_ROWS (a verify of batch 32 at K=4: 160 rows) row_invariant runs decode launches in pieces,
# which keep the row's bits; from ROW_INVARIANT_GEMM_MIN_ROWS (prefill chunks) the GEMM, whose rows agree
# among themselves.
INVARIANT_ROWS = ROWS + (129, 160)
GEMM_ROWS = (fp8_config.ROW_INVARIANT_GEMM_MIN_ROWS, fp8_config.ROW_INVARIANT_GEMM_MIN_ROWS + 16)


def _fp8_weight(rng, o, i):
    weight, scale = quantize_np(rng.standard_normal((o, i)).astype(np.float32) * 0.05)
    return jnp.asarray(weight), jnp.asarray(scale)


def _gemm_parted(fn, x) -> list[int]:
    f = jax.jit(fn)
    first = np.asarray(f(x[:GEMM_ROWS[0]])[0])
    return [m for m in GEMM_ROWS[1:] if not np.array_equal(np.asarray(f(x[:m])[0]), first)]


@pytest.mark.parametrize("row_invariant", [pytest.param(False, marks=pytest.mark.slow), True])  # False: the control
def test_pallas_fp8_row_alone_equals_row_in_a_launch_only_when_row_invariant(row_invariant):
    rng = np.random.default_rng(4)
    (w1, s1), (w2, s2) = _fp8_weight(rng, 384, 1280), _fp8_weight(rng, 200, 1280)  # split-K runs, a ragged O
    x = jnp.asarray(rng.standard_normal((GEMM_ROWS[-1], 1280)), jnp.bfloat16)

    def fn(x):  # two weights in one launch, as the model joins projections of one x
        ys = fm.fp8_matmul_many(x, (w1, w2), (s1, s2), jnp.float32, interpret=True, row_invariant=row_invariant)
        return jnp.concatenate(ys, axis=-1)

    parted = _parted(_row0_alone_and_in(fn, x, INVARIANT_ROWS)) + _gemm_parted(fn, x)
    if row_invariant:
        assert parted == []
    else:  # the default configs are not row-invariant: this is what row_invariant fixes
        assert parted != []


@pytest.mark.parametrize("out_features,in_features", [(96, 256), (1000, 384)])
def test_pallas_bf16_row_invariant_matmul(out_features, in_features):
    """bf16_matmul(row_invariant=True): one row's bits at every M, and the values of an f32 matmul."""
    rng = np.random.default_rng(out_features)
    w = jnp.asarray(rng.standard_normal((out_features, in_features)) * 0.05, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((GEMM_ROWS[-1], in_features)), jnp.bfloat16)

    def fn(x):
        return fm.bf16_matmul(x, w, jnp.float32, interpret=True, row_invariant=True)

    assert _parted(_row0_alone_and_in(fn, x, INVARIANT_ROWS)) == [] and _gemm_parted(fn, x) == []
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    got = np.asarray(fn(x))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_deterministic_linear_takes_the_row_invariant_kernels():
    """ops.linear / linear_many under KernelConfig(deterministic=True): FP8 and bf16 weights alike."""
    rng = np.random.default_rng(5)
    det = KernelConfig("pallas", deterministic=True)
    wq, sq = _fp8_weight(rng, 256, 384)
    fp8 = Fp8Block(wq, sq)
    w16 = jnp.asarray(rng.standard_normal((320, 384)) * 0.05, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((128, 384)), jnp.bfloat16)
    for fn in (lambda x: ops.linear(x, fp8, det, out_dtype=jnp.float32),
               lambda x: ops.linear(x, w16, det, out_dtype=jnp.float32),
               lambda x: ops.linear_many(x, (fp8, fp8), det)[1].astype(jnp.float32)):
        assert _parted(_row0_alone_and_in(fn, x, (5, 33, 128))) == []  # the kernels' own tests take every M
    with pytest.raises(ValueError, match="deterministic=True needs impl='pallas'"):
        KernelConfig("ref", deterministic=True)


H200_SHAPES = [((10240, 6144), 5120), ((17408, 17408), 5120), ((5120,), 17408), ((12288, 1024, 1024), 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("outs,in_features", H200_SHAPES, ids=lambda v: str(v))
def test_h200_fp8_launches_of_the_27b_step_are_row_invariant(outs, in_features):
    """The 27B step's FP8 launches (projections of one x joined) at 1..160 rows, on the H200."""
    key = jax.random.key(0)
    ws = [(jax.random.normal(jax.random.fold_in(key, j), (o, in_features)) * 64).clip(-448, 448)
          .astype(jnp.float8_e4m3fn) for j, o in enumerate(outs)]
    ss = [jnp.full((-(-o // 128), -(-in_features // 128)), 1e-4, jnp.float32) for o in outs]
    x = jax.random.normal(key, (GEMM_ROWS[-1], in_features)).astype(jnp.bfloat16)

    def fn(x):
        return jnp.concatenate(fm.fp8_matmul_many(x, ws, ss, jnp.float32, row_invariant=True), axis=-1)

    assert _parted(_row0_alone_and_in(fn, x, INVARIANT_ROWS)) == [] and _gemm_parted(fn, x) == []


@pytest.mark.gpu
@pytest.mark.parametrize("out_features", [248320, 96])
def test_h200_bf16_lm_head_and_gates_are_row_invariant(out_features):
    key = jax.random.key(1)
    w = (jax.random.normal(key, (out_features, 5120)) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(key, (GEMM_ROWS[-1], 5120)).astype(jnp.bfloat16)

    def fn(x):
        return fm.bf16_matmul(x, w, jnp.float32, row_invariant=True)

    assert _parted(_row0_alone_and_in(fn, x, INVARIANT_ROWS)) == [] and _gemm_parted(fn, x) == []


def test_row_groups_lower_for_h200():
    """40 rows of a 27B-shaped tiled FP8 launch and of the bf16 lm_head: three 16-row dots per chunk."""
    sds = jax.ShapeDtypeStruct
    o, i = 17408, 5120
    fp8_args = (sds((40, i), jnp.bfloat16), sds((o // 128, i // 128, 128, 128), jnp.float8_e4m3fn),
                sds((o // 128, i // 128), jnp.float32))
    bf16_args = (sds((40, i), jnp.bfloat16), sds((248320, i), jnp.bfloat16))
    for fn, args in ((lambda x, w, s: fm.fp8_matmul(x, w, s, jnp.bfloat16, row_invariant=True), fp8_args),
                     (lambda x, w: fm.bf16_matmul(x, w, jnp.float32, row_invariant=True), bf16_args)):
        [(_, ir_text)] = triton_calls(lower_for_h200(fn, args))
        assert ir_text.count("tt.dot ") == 3, ir_text.count("tt.dot ")
