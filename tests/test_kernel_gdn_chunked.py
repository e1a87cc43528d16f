"""pallas_kernels/gdn_chunked.py: the chunked GDN prefill kernel (interpret mode on the CPU) against
`gdn.gdn_chunked_ref` and `gdn.gdn_recurrence_ref` (outputs and final state), its blocked triangular
inverse against float64, padding tokens bit for bit, input validation, its lowering for the H200 (from
the CPU, in CI), and the kernel on the GPU at the 27B shapes (`gpu` marker).

Tolerances (relative to max |expected|, tolerance.py; u = 2^-24, the f32 unit roundoff).
 - The chunked form against the exact result (tests/test_kernel_gdn.py): every token goes through Dk-term
   dots and C-term chunk sums and solves, and the state update is a contraction, so errors add up over
   the T tokens without growing: T (Dk + C) u.
 - Plus the in-chunk cumsum: gamma_i is an f32 sum of up to C terms, so its absolute error is up to
   C u sum_chunk |g|, and it enters Gam_ij = exp(gamma_i - gamma_j) twice as a relative error; summed
   over the chunks that is 2 C u sum_t |g_t| (max over rows and heads). Small for model-like gates,
   dominant under strong decay (where the chunked form loses digits that the per-token rule keeps).
 - Two f32 implementations against each other (kernel vs a reference): twice one against the exact result.
 - The inverse Tm = (I + L)^-1 (forward substitution, blocked): |X - Tm| <= c C u |Tm| |I + L| |X|
   elementwise (Higham, Accuracy and Stability of Numerical Algorithms, ch. 8); c = 2 for the two stages
   (diagonal blocks, then the block rows).
An indexing, masking, decay or solve slip gives an O(1) relative error, far above these bounds.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from h200_lowering import attr_int, lower_for_h200, triton_calls
from pallas_kernels import gdn, gdn_chunked as gc
from tolerance import assert_close

U = 2.0 ** -24


def chunked_tol(g, t: int, dk: int, chunk: int, implementations: int = 2) -> float:
    """Worst-case relative rounding of `implementations` chunked f32 evaluations (see the docstring)."""
    g_sum = float(np.max(np.sum(np.abs(np.asarray(g, np.float64)), axis=1))) if t else 0.0
    return implementations * (max(t, 1) * (dk + chunk) + 2 * chunk * g_sum) * U


def make_inputs(b, t, hk, hv, dk, dv, seed=0, g_scale=0.3, beta=None):
    """Model-like inputs: q, k L2-normalised (q scaled by Dk^-0.5), g < 0, 0 < beta < 1 (or `beta`), a
    dense non-zero initial state."""
    rng = np.random.default_rng(seed)
    l2 = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = l2(rng.standard_normal((b, t, hk, dk))) * dk ** -0.5
    k = l2(rng.standard_normal((b, t, hk, dk)))
    v = rng.standard_normal((b, t, hv, dv))
    g = -g_scale * np.exp(0.5 * rng.standard_normal((b, t, hv)))
    if beta is None:
        beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, hv))))
    beta = np.broadcast_to(beta, (b, t, hv))
    s0 = rng.standard_normal((b, hv, dk, dv)) * 0.5
    return tuple(np.asarray(a, np.float32) for a in (q, k, v, g, beta, s0))


def check_against_refs(args, chunk, config=None, what=""):
    """The kernel (interpret mode) against the chunked reference (same chunk) and the per-token rule."""
    o, s = gc.gdn_chunked(*map(jnp.asarray, args), chunk=chunk, interpret=True, config=config)
    t, dk = args[0].shape[1], args[0].shape[3]
    tol = chunked_tol(args[3], t, dk, chunk)
    for name, ref in (("chunked ref", lambda *a: gdn.gdn_chunked_ref(*a, chunk=chunk)),
                      ("recurrence ref", gdn.gdn_recurrence_ref)):
        want_o, want_s = ref(*map(jnp.asarray, args))
        assert_close(o, want_o, tol, f"o vs {name} {what}")
        assert_close(s, want_s, tol, f"state vs {name} {what}")
    return o, s


# ------------------------------------------------------------------------------------------------
# the kernel (interpret mode) against the references
# ------------------------------------------------------------------------------------------------

NARROW = gc.ChunkedConfig(block_v=16)

CASES = {  # (b, t, hk, hv, dk, dv, chunk, config)
    "gqa_r3_two_chunks_ragged": (1, 70, 2, 6, 16, 32, 64, NARROW),  # r = 3 as the 27B; two Dv tiles
    "mha_b2_shorter_than_a_chunk": (2, 37, 2, 2, 32, 16, 64, None),  # block_v shrinks to Dv
    "gqa_b2_chunk32_four_chunks": (2, 100, 1, 2, 16, 16, 32, NARROW),
    "chunk16_six_chunks": (1, 90, 2, 4, 16, 16, 16, NARROW),  # one diagonal block: no block rows
    "one_token": (1, 1, 1, 2, 16, 16, 64, NARROW),
    "chunk128_three_chunks": (1, 300, 1, 2, 32, 32, 128, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_refs(name):
    b, t, hk, hv, dk, dv, chunk, config = CASES[name]
    check_against_refs(make_inputs(b, t, hk, hv, dk, dv, seed=len(name)), chunk, config, name)


def test_strong_decay_and_beta_near_one():
    """g down to -40 (exp(gamma) underflows to 0 inside a chunk; Gam above the diagonal would overflow
    without the mask), then weak decay in the same chunk; beta = 0.999 with highly correlated keys (L
    entries near 1, a Tm far from I)."""
    q, k, v, g, beta, s0 = make_inputs(2, 100, 1, 2, 16, 16, seed=5, beta=0.999)
    rng = np.random.default_rng(6)
    g[:, :30] = -rng.uniform(5.0, 40.0, g[:, :30].shape)
    g[:, 30:] = -0.01
    base = rng.standard_normal(16)
    k = (base + 0.3 * rng.standard_normal(k.shape)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    check_against_refs((q, k, v, g, beta, s0), 64, NARROW, "strong decay")


def test_padding_tokens_leave_the_state_unchanged():
    """45 real tokens, then 55 padding tokens (g = beta = 0, k = v = 0, q anything) filling the first chunk
    and the whole second: the state and the real tokens' outputs have the bits of the 45-token call."""
    q, k, v, g, beta, s0 = make_inputs(2, 100, 1, 2, 16, 16, seed=7)
    for x in (k, v, g, beta):
        x[:, 45:] = 0.0
    o, s = gc.gdn_chunked(*map(jnp.asarray, (q, k, v, g, beta, s0)), interpret=True, config=NARROW)
    o45, s45 = gc.gdn_chunked(*map(jnp.asarray, (q[:, :45], k[:, :45], v[:, :45], g[:, :45], beta[:, :45], s0)),
                              interpret=True, config=NARROW)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s45))
    np.testing.assert_array_equal(np.asarray(o[:, :45]), np.asarray(o45))
    want_o, want_s = gdn.gdn_recurrence_ref(*map(jnp.asarray, (q, k, v, g, beta, s0)))
    assert_close(o, want_o, chunked_tol(g, 100, 16, 64), "padded o vs recurrence")
    assert not np.array_equal(np.asarray(s), s0), "the real tokens moved the state"


def test_empty_input_returns_the_state():
    q, k, v, g, beta, s0 = make_inputs(1, 0, 1, 2, 16, 16)
    o, s = gc.gdn_chunked(*map(jnp.asarray, (q, k, v, g, beta, s0)), interpret=True)
    assert o.shape == (1, 0, 2, 16)
    np.testing.assert_array_equal(np.asarray(s), s0)


# ------------------------------------------------------------------------------------------------
# the blocked inverse against float64
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [16, 32, 64, 128])
def test_unit_lower_inverse_matches_float64(chunk):
    """L as the kernel builds it, from unit keys in 8 dimensions (|k_i.k_j| up to 1, both signs), beta near 1
    and mild decay: Tm is far from the first-order I - L, so a wrong block row or a missing substitution
    step shows."""
    rng = np.random.default_rng(chunk)
    k = rng.standard_normal((chunk, 8))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0.8, 1.0, chunk)
    gamma = np.cumsum(-rng.uniform(0.0, 0.05, chunk))
    lmat = np.tril(beta[:, None] * (k @ k.T) * np.exp(gamma[:, None] - gamma[None, :]), -1).astype(np.float32)
    got = np.asarray(jax.jit(gc._unit_lower_inverse)(jnp.asarray(lmat)), np.float64)
    a = np.eye(chunk) + lmat.astype(np.float64)
    want = np.linalg.inv(a)
    assert np.max(np.abs(want - (np.eye(chunk) - lmat))) > 0.3, "higher powers of L matter"
    bound = 2 * chunk * U * np.max(np.abs(want) @ np.abs(a) @ np.abs(want)) / np.max(np.abs(want))
    assert_close(got, want, bound, f"Tm, chunk {chunk}")
    assert np.all(np.triu(got, 1) == 0) and np.all(np.diag(got) == 1)


# ------------------------------------------------------------------------------------------------
# input validation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mutate, kw, match", [
    (lambda a: (a[0][..., 0],) + a[1:], {}, r"q must have 4 dims"),
    (lambda a: (a[0], a[1][:, :, :1]) + a[2:], {}, r"gdn: q .*k \(1, 5, 1, 16\)"),
    (lambda a: a[:2] + (a[2][:, :, :3],) + a[3:], {}, r"Hk \| Hv"),
    (lambda a: a[:3] + (a[3][:, :4],) + a[4:], {}, r"g \(1, 4, 4\)"),
    (lambda a: a[:4] + (a[4][..., :1],) + a[5:], {}, r"beta \(1, 5, 1\)"),
    (lambda a: a[:5] + (a[5][:, :, :8],), {}, r"state \(1, 4, 8, 32\)"),
    (lambda a: a[:3] + (a[3].astype(jnp.int32),) + a[4:], {}, r"g has dtype int32"),
    (lambda a: (a[0][..., :8], a[1][..., :8]) + a[2:5] + (a[5][:, :, :8],), {}, r"Dk \(q, k axis 3\) = 8"),
    (lambda a: a[:2] + (a[2][..., :24],) + a[3:5] + (a[5][..., :24],), {}, r"Dv \(v axis 3\) = 24"),
    (lambda a: a, dict(chunk=48), r"chunk = 48"),
    (lambda a: a, dict(chunk=8), r"chunk = 8"),
    (lambda a: a, dict(config=dict(block_v=16)), r"config must be a ChunkedConfig"),
])
def test_wrapper_rejects_bad_inputs(mutate, kw, match):
    args = tuple(map(jnp.asarray, make_inputs(1, 5, 2, 4, 16, 32)))
    with pytest.raises(ValueError, match=match):
        gc.gdn_chunked(*mutate(args), interpret=True, **kw)


def test_config_rejects_bad_block_v():
    for bad in (8, 48):
        with pytest.raises(ValueError, match="block_v"):
            gc.ChunkedConfig(block_v=bad)


# ------------------------------------------------------------------------------------------------
# lowering for the H200 from the CPU (CI): Pallas -> Triton IR, verified; PTX is built by XLA on the GPU
# ------------------------------------------------------------------------------------------------

REAL = dict(hk=16, hv=48, dk=128, dv=128)  # Qwen3.5-27B's GDN heads


def real_shapes(b, t, dtype=jnp.float32):
    sds = jax.ShapeDtypeStruct
    return (sds((b, t, REAL["hk"], REAL["dk"]), dtype), sds((b, t, REAL["hk"], REAL["dk"]), dtype),
            sds((b, t, REAL["hv"], REAL["dv"]), dtype), sds((b, t, REAL["hv"]), jnp.float32),
            sds((b, t, REAL["hv"]), jnp.float32), sds((b, REAL["hv"], REAL["dk"], REAL["dv"]), jnp.float32))


@pytest.mark.parametrize("b, t, dtype", [(1, 2048, jnp.float32), (2, 300, jnp.bfloat16)])
def test_kernel_lowers_for_h200(b, t, dtype):
    """One program per (batch row, value head, BV columns of Dv); the chunks are one scf.for carrying the
    [Dk, BV] f32 state, the diagonal-block substitution a second (nested) one; 12 IEEE f32 dots per chunk
    (K K^T, M, 3 block-row steps, U, W, W S, Q K^T, Q S, the intra-chunk product, the state update)."""
    cfg0, chunk = gc.CHUNKED_CONFIG, 64
    [(cfg, ir_text)] = triton_calls(lower_for_h200(gc.gdn_chunked, real_shapes(b, t, dtype)))
    grid = [attr_int(cfg, f"grid_{a}") for a in "xyz"]
    assert grid == [b, REAL["hv"], REAL["dv"] // cfg0.block_v], grid
    assert attr_int(cfg, "num_warps") == cfg0.num_warps and attr_int(cfg, "num_stages") == cfg0.num_stages
    assert "tt.func public @gdn_chunked" in ir_text
    bv, dk = cfg0.block_v, REAL["dk"]
    loops = re.findall(r"scf\.for .* -> \((tensor<[^>]*>)\)", ir_text)
    nb = chunk // gc.SUB
    assert loops == [f"tensor<{dk}x{bv}xf32>", f"tensor<{nb}x{gc.SUB}x{gc.SUB}xf32>"], loops  # chunks, substitution
    assert ir_text.count("tt.dot") == 12
    assert "tf32" not in ir_text, "every dot IEEE f32 (Precision.HIGHEST)"
    for tiles in (f"tensor<{chunk}x{dk}xf32> * tensor<{dk}x{bv}xf32>",  # W S and Q S
                  f"tensor<{dk}x{chunk}xf32> * tensor<{chunk}x{bv}xf32>",  # K^T Vn
                  f"tensor<{chunk}x{chunk}xf32> * tensor<{chunk}x{chunk}xf32>"):  # the block rows of Tm
        assert tiles in ir_text, tiles


# ------------------------------------------------------------------------------------------------
# on the GPU (deselected on the CPU):
#   JAX_PLATFORMS=cuda .venv/bin/python -m pytest -q -m gpu tests/test_kernel_gdn_chunked.py
# ------------------------------------------------------------------------------------------------


def gpu_required():
    if jax.default_backend() != "gpu":
        pytest.fail(f"gpu test on backend {jax.default_backend()!r}: run with JAX_PLATFORMS=cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("b, t, n_real", [(1, 2048, 2048), (2, 1000, 777)])
def test_gpu_kernel_matches_refs_real_shapes(b, t, n_real):
    """The 27B's GDN heads; the second case ragged (T = 1000) with padding tokens past n_real."""
    gpu_required()
    args = make_inputs(b, t, REAL["hk"], REAL["hv"], REAL["dk"], REAL["dv"], seed=t)
    for x in args[1:5]:
        x[:, n_real:] = 0.0
    jargs = tuple(map(jnp.asarray, args))
    o, s = gc.gdn_chunked(*jargs)
    tol = chunked_tol(args[3], t, REAL["dk"], 64)
    for name, ref in (("chunked ref", gdn.gdn_chunked_ref), ("recurrence ref", gdn.gdn_recurrence_ref)):
        want_o, want_s = ref(*jargs)
        assert_close(o, want_o, tol, f"gpu o vs {name}")
        assert_close(s, want_s, tol, f"gpu state vs {name}")
    if n_real < t:  # padding leaves the state's bits
        o_real, s_real = gc.gdn_chunked(*(x[:, :n_real] for x in jargs[:5]), jargs[5])
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_real))
