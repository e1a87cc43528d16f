"""pallas_kernels/paged_attention.py: the reference against a float64 numpy attention over the
contiguous context (written here), the Pallas kernel (interpret mode on the CPU) against the
reference on awkward shapes with NaN-poisoned slots, its lowering for the H200 (checked from the CPU
in CI), and the kernel on the GPU (`gpu` marker).

Tolerances (relative to max |expected|, tolerance.py). u = 2^-24 is the f32 unit roundoff.
 - A score is a D-term f32 dot: |error| <= (D + 2) u s_bound, where s_bound = scale max|q|_2 max|k|_2
   bounds sum_i |q_i k_i| scale (Cauchy-Schwarz). exp(s - m) turns an absolute score error into the
   same relative probability error; the max shift, the scaling by log2(e) and the online rescales
   add a few u more (16 u allowed).
 - The normaliser and P @ V are n-term sums (n = keys): a reordered sum is within n u of the exact
   one, relative to the sum of |terms|, i.e. to max|v| for P @ V: two sums, 2 n u.
 - Errors relative to max|v| become relative to max|o| by the factor max|v| / max|o| (the output is a
   weighted mean of values and may cancel).
 - Two f32 implementations against each other: twice one against the exact result.
 - bf16 KV (GPU): the kernel rounds the probabilities to bf16 before P @ V (2^-9 relative per term,
   <= 2^-9 max|v| in the sum) and both round o to bf16 (2^-9 |o| each).
An indexing, masking or rescaling slip gives an O(1) relative error, far above these bounds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from tolerance import assert_close
from h200_lowering import H200, lower_for_h200, triton_calls, attr_int

F32_UNIT_ROUNDOFF = 2.0 ** -24
BF16_UNIT_ROUNDOFF = 2.0 ** -9
LOG2E = math.log2(math.e)
POISON = np.nan  # unused pages, slots past the length and spare page-table entries hold garbage


def f32_attention_tol(q, k_ctx, v_ctx, o_expected, scale, n_keys, implementations=1):
    """Worst-case relative error of `implementations` f32 attentions over n_keys keys (see docstring)."""
    q, k_ctx, v_ctx = (np.asarray(a, np.float64) for a in (q, k_ctx, v_ctx))
    d = q.shape[-1]
    s_bound = scale * np.linalg.norm(q, axis=-1).max() * np.nan_to_num(np.linalg.norm(k_ctx, axis=-1)).max()
    e_prob = ((d + 2) * s_bound * LOG2E + 16) * F32_UNIT_ROUNDOFF
    e_sums = 2 * n_keys * F32_UNIT_ROUNDOFF
    v_over_o = np.nanmax(np.abs(v_ctx)) / max(np.max(np.abs(np.asarray(o_expected, np.float64))), 1e-30)
    return implementations * (e_prob + e_sums) * v_over_o


def bf16_attention_tol(q, k_ctx, v_ctx, o_expected, scale, n_keys):
    """Kernel (bf16 probabilities, bf16 output) vs reference (f32, bf16 output)."""
    v_over_o = np.nanmax(np.abs(np.asarray(v_ctx, np.float64))) / max(
        np.max(np.abs(np.asarray(o_expected, np.float64))), 1e-30)
    return (f32_attention_tol(q, k_ctx, v_ctx, o_expected, scale, n_keys, implementations=2)
            + BF16_UNIT_ROUNDOFF * (v_over_o + 2))


# ------------------------------------------------------------------------------------------------
# inputs: a contiguous context per sequence, scattered into shuffled pages; everything else poisoned
# ------------------------------------------------------------------------------------------------


class Case:
    """committed[b] tokens already in the cache, n_valid[b] of the T new queries are real (the rest are
    padding): q_positions = committed + t, kv_lengths = committed + n_valid (as qmtp.model.layers.attention)."""

    def __init__(self, *, b, t, hq, hkv, d, s, committed, n_valid, seed=0, dtype=np.float32, q_gain=1.0,
                 spare_pages=3, poison=POISON):
        rng = np.random.default_rng(seed)
        committed, n_valid = np.asarray(committed, np.int32), np.asarray(n_valid, np.int32)
        assert committed.shape == n_valid.shape == (b,) and np.all(n_valid <= t)
        self.kv_lengths = committed + n_valid
        self.q_positions = (committed[:, None] + np.arange(t, dtype=np.int32)[None]).astype(np.int32)
        need = -(-self.kv_lengths // s)  # pages holding keys
        pmax = int(need.max()) + 1  # one spare table entry per sequence at least
        n_pages = int(need.sum()) + spare_pages
        n_ctx = pmax * s
        cast = lambda x: np.array(jnp.asarray(x, dtype).astype(jnp.float32))  # values exactly representable
        self.scale = d ** -0.5
        self.q = cast(rng.standard_normal((b, t, hq, d)) * q_gain)
        self.k_ctx = cast(rng.standard_normal((b, n_ctx, hkv, d)))
        self.v_ctx = cast(rng.standard_normal((b, n_ctx, hkv, d)))
        self.k_pages = np.full((n_pages, s, hkv, d), poison, np.float32)
        self.v_pages = np.full((n_pages, s, hkv, d), poison, np.float32)
        garbage = np.array([-7, n_pages, 10 ** 6], np.int32)  # spare entries: never to be followed
        self.page_table = garbage[rng.integers(0, 3, (b, pmax))]
        free = iter(rng.permutation(n_pages))
        for i in range(b):
            for p in range(need[i]):
                page = next(free)
                self.page_table[i, p] = page
                for slot in range(s):
                    j = p * s + slot
                    if j < self.kv_lengths[i]:  # slots past the length keep the poison
                        self.k_pages[page, slot] = self.k_ctx[i, j]
                        self.v_pages[page, slot] = self.v_ctx[i, j]
        for i in range(b):  # the contiguous truth: poison past the length as well
            self.k_ctx[i, self.kv_lengths[i]:] = poison
            self.v_ctx[i, self.kv_lengths[i]:] = poison
        self.dtype = dtype
        self.n_keys = int(max(self.kv_lengths.max(), 1))

    def args(self):
        dt = self.dtype
        return (jnp.asarray(self.q, dt), jnp.asarray(self.k_pages, dt), jnp.asarray(self.v_pages, dt),
                jnp.asarray(self.page_table), jnp.asarray(self.q_positions), jnp.asarray(self.kv_lengths),
                self.scale)


def np_attention(q, k_ctx, v_ctx, q_positions, kv_lengths, scale):
    """float64 causal GQA attention over the contiguous context, one (b, t, h) at a time."""
    b, t, hq, d = q.shape
    hkv = k_ctx.shape[2]
    o = np.zeros((b, t, hq, d))
    for i in range(b):
        for tt in range(t):
            n = min(int(kv_lengths[i]), int(q_positions[i, tt]) + 1)
            if n <= 0:
                continue  # no valid key: 0
            for h in range(hq):
                kh = h // (hq // hkv)
                keys = np.asarray(k_ctx[i, :n, kh], np.float64)
                vals = np.asarray(v_ctx[i, :n, kh], np.float64)
                s = keys @ np.asarray(q[i, tt, h], np.float64) * scale
                p = np.exp(s - s.max())
                o[i, tt, h] = p @ vals / p.sum()
    return o


def case_f64(c: Case):
    return np_attention(c.q, c.k_ctx, c.v_ctx, c.q_positions, c.kv_lengths, c.scale)


# ------------------------------------------------------------------------------------------------
# the shapes: page sizes 1, 3 (not a power of two), 16 and 64 (larger than the context); GQA and MHA;
# lengths on, before and after page edges; padded queries; an empty sequence; several key splits
# ------------------------------------------------------------------------------------------------

SPLIT = pa.PagedAttentionConfig(block_k=16, min_keys_per_split=16, target_programs=64)  # many splits
PREFILL_BLOCKS = pa.PagedAttentionConfig(block_k=16, max_block_queries=2, prefill_rows=16)
PREFILL_SPLITS = pa.PagedAttentionConfig(block_k=16, max_block_queries=2, prefill_rows=16, target_programs=64,
                                         prefill_min_keys_per_split=16)  # 2 seqs x 3 blocks x 2 KV heads: 6 splits

CASES = {
    "b1_t1_mha_s1": (dict(b=1, t=1, hq=2, hkv=2, d=16, s=1, committed=[6], n_valid=[1]), None),
    "b3_t5_gqa_s3": (dict(b=3, t=5, hq=6, hkv=2, d=16, s=3, committed=[0, 4, 10], n_valid=[5, 2, 0]), None),
    "b3_t1_gqa_s3_d32_empty": (dict(b=3, t=1, hq=6, hkv=2, d=32, s=3, committed=[2, 8, 0], n_valid=[1, 1, 0]),
                               None),
    "b3_t5_mha_s16_edges": (dict(b=3, t=5, hq=4, hkv=4, d=32, s=16, committed=[11, 12, 27], n_valid=[5, 4, 5]),
                            None),
    "b1_t5_gqa_s64_big_page": (dict(b=1, t=5, hq=6, hkv=2, d=16, s=64, committed=[7], n_valid=[3]), None),
    "b3_t5_gqa_s3_splits": (dict(b=3, t=5, hq=6, hkv=2, d=16, s=3, committed=[30, 47, 3], n_valid=[5, 3, 1]),
                            SPLIT),
    "b3_t1_gqa_s16_splits": (dict(b=3, t=1, hq=6, hkv=2, d=32, s=16, committed=[70, 100, 16], n_valid=[1, 1, 0]),
                             SPLIT),
    # prefills: query blocks of 5 tokens x 3 heads (a ragged last block), after cached tokens and not
    "b2_t40_gqa_s16_prefill_blocks": (dict(b=2, t=40, hq=6, hkv=2, d=32, s=16, committed=[0, 13], n_valid=[40, 29]),
                                      PREFILL_BLOCKS),
    "b1_t24_mha_s3_prefill_one_block": (dict(b=1, t=24, hq=2, hkv=2, d=16, s=3, committed=[21], n_valid=[24]), None),
    # a short prefill after a long context (a serving piece): few query blocks, their keys split
    "b2_t12_gqa_s16_prefill_split_keys": (dict(b=2, t=12, hq=6, hkv=2, d=32, s=16, committed=[70, 100],
                                               n_valid=[12, 7]), PREFILL_SPLITS),
}


def run_kernel(c: Case, config=None, interpret=True):
    return np.asarray(pa.paged_attention(*c.args(), interpret=interpret, config=config)).astype(np.float64)


def run_ref(c: Case):
    return np.asarray(pa.paged_attention_ref(*c.args())).astype(np.float64)


# ------------------------------------------------------------------------------------------------
# the reference against float64 numpy
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_ref_matches_float64(name):
    c = Case(**CASES[name][0])
    want = case_f64(c)
    assert_close(run_ref(c), want, f32_attention_tol(c.q, c.k_ctx, c.v_ctx, want, c.scale, c.n_keys),
                 f"ref vs float64 [{name}]")


def test_ref_bf16_rounds_once():
    c = Case(**CASES["b3_t5_gqa_s3"][0], dtype=jnp.bfloat16)
    want = case_f64(c)  # from the same (bf16-representable) inputs
    tol = f32_attention_tol(c.q, c.k_ctx, c.v_ctx, want, c.scale, c.n_keys) + BF16_UNIT_ROUNDOFF
    assert_close(run_ref(c), want, tol, "bf16 ref vs float64")


# ------------------------------------------------------------------------------------------------
# the kernel (interpret mode) against the reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_ref(name):
    kw, config = CASES[name]
    c = Case(**kw, seed=1)
    want = run_ref(c)
    got = run_kernel(c, config)
    tol = f32_attention_tol(c.q, c.k_ctx, c.v_ctx, want, c.scale, c.n_keys, implementations=2)
    assert_close(got, want, tol, f"kernel vs ref [{name}]")
    assert_close(got, case_f64(c), tol, f"kernel vs float64 [{name}]")


def test_kernel_bf16_matches_ref():
    c = Case(**CASES["b3_t5_gqa_s3_splits"][0], dtype=jnp.bfloat16, seed=2)
    want = run_ref(c)
    got = run_kernel(c, SPLIT)
    assert_close(got, want, bf16_attention_tol(c.q, c.k_ctx, c.v_ctx, want, c.scale, c.n_keys), "bf16 kernel")


def test_kernel_ignores_poison_and_empty_rows_are_zero():
    """The output cannot depend on what unused pages, slots past the length and spare table entries
    hold: NaN, Inf and finite garbage give the same bits. Rows with no valid key are exactly 0."""
    kw, config = CASES["b3_t1_gqa_s16_splits"]
    outs = [run_kernel(Case(**kw, seed=3, poison=p), config) for p in (np.nan, np.inf, -3e4)]
    assert np.all(np.isfinite(outs[0]))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    kw, config = CASES["b3_t1_gqa_s3_d32_empty"]  # sequence 2: kv_length 0
    o = run_kernel(Case(**kw, seed=4), config)
    assert np.all(o[2] == 0.0), "no valid key: output 0"
    assert np.all(np.abs(o[:2]) > 0)


def test_kernel_split_count_does_not_change_result():
    kw, _ = CASES["b3_t5_gqa_s3_splits"]
    c = Case(**kw, seed=5)
    want = run_ref(c)
    tol = f32_attention_tol(c.q, c.k_ctx, c.v_ctx, want, c.scale, c.n_keys, implementations=2)
    one = run_kernel(c, pa.PagedAttentionConfig(block_k=16, target_programs=1))
    many = run_kernel(c, SPLIT)
    assert pa.PagedAttentionConfig(block_k=16, target_programs=1).num_splits(3, 2, 60) == 1
    assert SPLIT.num_splits(3, 2, 60) > 3
    assert_close(one, want, tol, "one split")
    assert_close(many, one, tol, "many splits vs one")


INVARIANT = pa.PagedAttentionConfig(block_k=16, split_keys=32)  # the row-invariant form at test scale


@pytest.mark.parametrize("config, invariant", [(INVARIANT, True), (SPLIT, False)], ids=["fixed_splits", "default"])
def test_a_query_alone_equals_the_query_in_a_verify_of_a_batch(config, invariant):
    """Under split_keys a query decoded alone (B = 1, T = 1, a wider page table) gives the bits it gets as
    token 1 of a 4-token verify in a batch of 3: its keys fall in the same splits and steps, the later
    tokens' keys and the extra splits add exact zeros. The default form moves the split edges with the
    batch and the length, and its bits differ here (the control: alone, 32 splits added in two groups of
    COMBINE_GROUP, in the verify 11; at a 150-token context the two forms' sums happened to agree on one
    CPU and differ on another)."""
    c = Case(b=3, t=4, hq=6, hkv=2, d=16, s=3, committed=[400, 90, 200], n_valid=[4, 4, 4], seed=7)
    verify = run_kernel(c, config)[0, 1]  # sequence 0, token 1: position 401
    q, k_pages, v_pages, table, _, _, scale = c.args()
    wide = jnp.concatenate([table[:1], jnp.full((1, table.shape[1]), -7, jnp.int32)], axis=1)
    alone = pa.paged_attention(q[:1, 1:2], k_pages, v_pages, wide, jnp.array([[401]]), jnp.array([402]), scale,
                               interpret=True, config=config)
    alone = np.asarray(alone).astype(np.float64)[0, 0]
    assert config.num_splits(1, 2, wide.shape[1] * 3) != config.num_splits(3, 2, table.shape[1] * 3)
    if invariant:
        np.testing.assert_array_equal(alone, verify)
    else:
        assert not np.array_equal(alone, verify)
    tol = f32_attention_tol(c.q, c.k_ctx, c.v_ctx, verify, c.scale, c.n_keys, implementations=2)
    assert_close(alone, case_f64(c)[0, 1], tol, "alone vs float64")


def test_sum_splits_in_order_ignores_trailing_zero_splits():
    """The fixed combine order: appending zero splits (a wider page table) keeps every bit."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2, 3, 21, 5)) * 10.0 ** rng.integers(-6, 7, (2, 3, 21, 5)), jnp.float32)
    wider = jnp.concatenate([x, jnp.zeros((2, 3, 30, 5), jnp.float32)], axis=2)
    np.testing.assert_array_equal(pa._sum_splits_in_order(x), pa._sum_splits_in_order(wider))
    np.testing.assert_allclose(pa._sum_splits_in_order(x), np.sum(np.asarray(x, np.float64), axis=2), rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(x))))


def test_config_rules():
    cfg = pa.DEFAULT_CONFIG
    assert cfg.keys_per_step(256, 2) == 64  # bf16, D 256: 64 keys of K and V = 64 KiB per step
    assert cfg.keys_per_step(256, 4) == 32  # f32 halves the step
    assert cfg.num_splits(1, 4, 4096) == 32 and cfg.num_splits(8, 4, 4096) == 9  # >= 128 programs
    assert cfg.num_splits(8, 4, 64) == 1
    # prefills: 1024 keys of the page table a split at least (a 64-token prompt's 4 blocks at 4k: 4 splits)
    assert cfg.num_splits(4, 4, 4096, cfg.prefill_min_keys_per_split) == 4
    assert cfg.num_splits(7, 4, 32768, cfg.prefill_min_keys_per_split) == 10
    with pytest.raises(ValueError, match="power of two"):
        pa.PagedAttentionConfig(block_k=48)
    fixed = pa.ROW_INVARIANT_CONFIG  # splits of 512 keys whatever the batch
    assert fixed.num_splits(1, 4, 4096) == fixed.num_splits(32, 4, 4096) == 8
    assert fixed.num_splits(1, 4, 4097) == 9
    for bad in (32, 96):
        with pytest.raises(ValueError, match="split_keys"):
            pa.PagedAttentionConfig(split_keys=bad)


@pytest.mark.parametrize("mutate, match", [
    (lambda a: (a[0][:, :, :5],) + a[1:], "multiple of Hkv"),
    (lambda a: (a[0], a[1][..., :8], a[2][..., :8]) + a[3:], r"\[P, S, Hkv, 16\]"),
    (lambda a: a[:3] + (a[3].astype(jnp.float32),) + a[4:], "page_table must be an integer"),
    (lambda a: a[:4] + (a[4][:, :1],) + a[5:], "do not match q"),
    (lambda a: a[:5] + (a[5][:, None],) + a[6:], "kv_lengths must have 1 dims"),
    (lambda a: (a[0].astype(jnp.int32),) + a[1:], "q dtype int32"),
    (lambda a: a[:2] + (a[2].astype(jnp.bfloat16),) + a[3:], "differ"),
    (lambda a: a[:6] + (jnp.float32(0.25),), "scale must be a Python float"),
])
def test_wrapper_rejects_bad_inputs(mutate, match):
    c = Case(**CASES["b3_t5_gqa_s3"][0])
    with pytest.raises(ValueError, match=match):
        pa.paged_attention(*mutate(c.args()), interpret=True)


def test_wrapper_rejects_head_dim_not_power_of_two():
    c = Case(b=1, t=1, hq=2, hkv=1, d=24, s=4, committed=[3], n_valid=[1])
    with pytest.raises(ValueError, match="power of two"):
        pa.paged_attention(*c.args(), interpret=True)


# ------------------------------------------------------------------------------------------------
# lowering for the H200 from the CPU (CI): Pallas -> Triton IR, verified; PTX is built by XLA on the GPU
# ------------------------------------------------------------------------------------------------

REAL = dict(hq=24, hkv=4, d=256, s=16, context=4096)


def real_shapes(b, t, dtype=jnp.bfloat16):
    pmax = REAL["context"] // REAL["s"]
    sds = jax.ShapeDtypeStruct
    return (sds((b, t, REAL["hq"], REAL["d"]), dtype),
            sds((b * pmax, REAL["s"], REAL["hkv"], REAL["d"]), dtype),
            sds((b * pmax, REAL["s"], REAL["hkv"], REAL["d"]), dtype),
            sds((b, pmax), jnp.int32), sds((b, t), jnp.int32), sds((b,), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("b", [1, 8])
def test_kernel_lowers_for_h200(b, t, dtype):
    cfg0 = pa.DEFAULT_CONFIG
    lowered = lower_for_h200(lambda *a: pa.paged_attention(*a, REAL["d"] ** -0.5), real_shapes(b, t, dtype))
    [(cfg, ir_text)] = triton_calls(lowered)
    n_splits = cfg0.num_splits(b, REAL["hkv"], REAL["context"])
    grid = [attr_int(cfg, f"grid_{a}") for a in "xyz"]
    assert math.prod(grid) == b * REAL["hkv"] * n_splits, grid
    assert attr_int(cfg, "num_warps") == cfg0.num_warps and attr_int(cfg, "num_stages") == cfg0.num_stages
    assert "tt.func public @paged_attention" in ir_text
    assert "scf.for" in ir_text, "the key loop (dynamic bound) is missing"
    assert ir_text.count("tt.dot") == 2, "Q.K^T and P.V"
    rows = max(16, 1 << (6 * t - 1).bit_length())
    bk = cfg0.keys_per_step(REAL["d"], jnp.dtype(dtype).itemsize)
    el = "bf16" if dtype == jnp.bfloat16 else "f32"
    assert f"tensor<{rows}x{REAL['d']}x{el}> * tensor<{REAL['d']}x{bk}x{el}>" in ir_text, "Q.K^T tile shapes"


@pytest.mark.parametrize("b, t", [(1, 1), (8, 5)])
def test_fixed_splits_lower_for_h200(b, t):
    """ROW_INVARIANT_CONFIG at the 27B shapes: cdiv(context, 512) splits per KV head at every batch."""
    cfg0 = pa.ROW_INVARIANT_CONFIG
    lowered = lower_for_h200(lambda *a: pa.paged_attention(*a, REAL["d"] ** -0.5, config=cfg0),
                             real_shapes(b, t, jnp.bfloat16))
    [(cfg, _)] = triton_calls(lowered)
    grid = [attr_int(cfg, f"grid_{a}") for a in "xyz"]
    assert math.prod(grid) == b * REAL["hkv"] * -(-REAL["context"] // cfg0.split_keys), grid


def test_prefill_lowers_for_h200_in_query_blocks():
    """A 2048-token prefill at the 27B shapes: prefill_rows // G tokens per program, one program per query
    block and KV head (no key splits), [prefill_rows, D] query tiles on prefill_num_warps warps: no score
    matrix in memory."""
    cfg0, t = pa.DEFAULT_CONFIG, 2048
    lowered = lower_for_h200(lambda *a: pa.paged_attention(*a, REAL["d"] ** -0.5), real_shapes(1, t, jnp.bfloat16))
    [(cfg, ir_text)] = triton_calls(lowered)
    t_block = cfg0.prefill_rows // (REAL["hq"] // REAL["hkv"])
    grid = [attr_int(cfg, f"grid_{a}") for a in "xyz"]
    assert math.prod(grid) == REAL["hkv"] * -(-t // t_block), grid
    assert f"tensor<{cfg0.prefill_rows}x{REAL['d']}xbf16> * tensor<{REAL['d']}x" in ir_text, "Q.K^T tile shapes"
    assert attr_int(cfg, "num_warps") == cfg0.prefill_num_warps != cfg0.num_warps


def test_a_short_prefill_at_long_context_splits_its_keys():
    """A 128-token piece at 32k context (27B shapes) has 7 query blocks x 4 KV heads: without key splits 28
    programs would each read the whole context. It runs num_splits(7, 4, 32k) of them per block."""
    cfg0, t, context = pa.DEFAULT_CONFIG, 128, 32768
    shapes = list(real_shapes(1, t, jnp.bfloat16))
    pmax = context // REAL["s"]
    shapes[1] = shapes[2] = jax.ShapeDtypeStruct((pmax, REAL["s"], REAL["hkv"], REAL["d"]), jnp.bfloat16)
    shapes[3] = jax.ShapeDtypeStruct((1, pmax), jnp.int32)
    lowered = lower_for_h200(lambda *a: pa.paged_attention(*a, REAL["d"] ** -0.5), shapes)
    [(cfg, _)] = triton_calls(lowered)
    n_qblocks = -(-t // (cfg0.prefill_rows // (REAL["hq"] // REAL["hkv"])))
    n_splits = cfg0.num_splits(n_qblocks, REAL["hkv"], context, cfg0.prefill_min_keys_per_split)
    assert n_qblocks == 7 and n_splits > 1
    grid = [attr_int(cfg, f"grid_{a}") for a in "xyz"]
    assert math.prod(grid) == REAL["hkv"] * n_qblocks * n_splits, grid


# ------------------------------------------------------------------------------------------------
# on the GPU (deselected on the CPU):
#   JAX_PLATFORMS=cuda .venv/bin/python -m pytest -q -m gpu tests/test_kernel_paged_attention.py
# ------------------------------------------------------------------------------------------------


def real_case(b, t, dtype, seed):
    rng = np.random.default_rng(seed)
    ctx = REAL["context"]
    committed = ctx - t - rng.integers(0, 200, b)  # lengths anywhere inside a page
    n_valid = rng.integers(0, t + 1, b)
    n_valid[0] = t
    return Case(b=b, t=t, hq=REAL["hq"], hkv=REAL["hkv"], d=REAL["d"], s=REAL["s"], committed=committed,
                n_valid=n_valid, seed=seed, dtype=dtype, q_gain=2.0, spare_pages=7)


def gpu_required():
    if jax.default_backend() != "gpu":
        pytest.fail(f"gpu test on backend {jax.default_backend()!r}: run with JAX_PLATFORMS=cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("b", [1, 8])
def test_gpu_kernel_matches_ref_real_shapes(b, t, dtype):
    gpu_required()
    c = real_case(b, t, dtype, seed=10 * b + t)
    want = run_ref(c)
    got = run_kernel(c, interpret=False)
    if dtype == jnp.bfloat16:
        tol = bf16_attention_tol(c.q, c.k_ctx, c.v_ctx, want, c.scale, c.n_keys)
    else:
        tol = f32_attention_tol(c.q, c.k_ctx, c.v_ctx, want, c.scale, c.n_keys, implementations=2)
    assert_close(got, want, tol, f"gpu kernel b={b} t={t} {jnp.dtype(dtype).name}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_kernel_awkward_shapes(name):
    gpu_required()
    kw, config = CASES[name]
    c = Case(**kw, seed=1)
    want = run_ref(c)
    got = run_kernel(c, config, interpret=False)
    assert_close(got, want, f32_attention_tol(c.q, c.k_ctx, c.v_ctx, want, c.scale, c.n_keys, implementations=2),
                 f"gpu kernel vs ref [{name}]")
    if name == "b3_t1_gqa_s3_d32_empty":
        assert np.all(got[2] == 0.0)


@pytest.mark.gpu
def test_gpu_kernel_ignores_poison():
    gpu_required()
    outs = [run_kernel(real_case(8, 5, jnp.bfloat16, seed=7), interpret=False)]
    c = real_case(8, 5, jnp.bfloat16, seed=7)
    c.k_pages = np.where(np.isnan(c.k_pages), np.float32(np.inf), c.k_pages)
    c.v_pages = np.where(np.isnan(c.v_pages), np.float32(-np.inf), c.v_pages)
    outs.append(run_kernel(c, interpret=False))
    assert np.all(np.isfinite(outs[0]))
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [2, 5])
def test_gpu_fixed_splits_query_alone_equals_query_in_a_verify_of_a_batch(t):
    """ROW_INVARIANT_CONFIG on the H200 at the 27B shapes, bf16 KV: every token of a T-token verify in a batch
    of 8 gives the bits it gets decoded alone (B = 1, T = 1)."""
    gpu_required()
    config = pa.ROW_INVARIANT_CONFIG
    c = real_case(8, t, jnp.bfloat16, seed=40 + t)
    c_args = c.args()
    verify = np.asarray(pa.paged_attention(*c_args[:-1], c.scale, config=config))
    q, k_pages, v_pages, table, positions, lengths, scale = c_args
    for b in range(8):
        for i in range(int(c.kv_lengths[b] - c.q_positions[b, 0])):  # the sequence's real tokens
            pos = int(c.q_positions[b, i])
            alone = pa.paged_attention(q[b:b + 1, i:i + 1], k_pages, v_pages, table[b:b + 1], jnp.array([[pos]]),
                                       jnp.array([pos + 1]), scale, config=config)
            np.testing.assert_array_equal(np.asarray(alone)[0, 0], verify[b, i], err_msg=f"sequence {b} token {i}")
