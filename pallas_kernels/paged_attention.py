"""Attention of T queries per sequence over a paged KV cache (GQA, causal, lengths-masked).

    o[b, t, h] = sum_j softmax_j(q[b, t, h] . k_j * scale) v_j     over key positions j with
                 j < kv_lengths[b] and j <= q_positions[b, t]

Key j of sequence b lives in page page_table[b, j // S], slot j % S; query head h reads KV head h // (Hq/Hkv).
q [B, T, Hq, D]; k_pages, v_pages [P, S, Hkv, D]; page_table [B, Pmax], q_positions [B, T], kv_lengths [B]
int32 -> o [B, T, Hq, D] in q's dtype, softmax in f32. Masked slots may hold anything (NaN included); a row
with no valid key outputs 0. `paged_attention_ref` gathers the pages into a contiguous context.

Kernel grid (B, Hkv, NQ*NS): program (b, h, q, s) takes kv head h's R = pow2(max(16, G*TB)) query rows
(r = t*G + g, G = Hq/Hkv) of TB tokens (TB = T up to max_block_queries; a prefill's NQ blocks of
prefill_rows // G tokens on prefill_num_warps warps) so each K/V row is read once per kv head, block and
split, and keys [s*L, min((s+1)*L, n)), n = min(kv_lengths[b], Pmax*S, the block's last position + 1),
L = round_up(cdiv(n, NS), BK): keys past the length or the block's causal limit are never read and every
split gets work (NS from the B * NQ programs; 1 for a prefill in the row-invariant form). Each step gathers
BK keys by page id (clamped to [0, P)), so any page size works; online softmax in base 2, masked scores
-inf by `where`, masked K/V never loaded. A jnp step combines the splits
(weights exp2(m_s - max m)).

Row-invariant form (PagedAttentionConfig.split_keys = L fixed, ROW_INVARIANT_CONFIG): split s covers keys
[s*L, (s+1)*L) whatever B, T or n, NS = cdiv(Pmax*S, L), and the splits are added in one fixed order
(left to right in groups of COMBINE_GROUP, then the groups left to right). A query's keys then fall in
the same splits and BK steps alone, in a verify or in a batch; keys past it (a later query of its block)
add exact zeros (weight exp2(-inf) = 0, rescale exp2(0) = 1), and so do the empty trailing splits of a
wider page table. The default form picks NS from B and L from n, so a row's sum order moves with both.
q is cast to the KV dtype: bf16/f16 KV take tensor-core dots (P rounded to it for P @ V, as flash attention),
f32 KV IEEE f32 dots (HIGHEST). D: a power of two >= 16. Loads gather with index arrays (the Triton lowering
has no scalar prefetch; interpret mode cannot mix index arrays with slices).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._vma import align
from pallas_kernels.fp8_config import next_pow2


def _check(q, k_pages, v_pages, page_table, q_positions, kv_lengths) -> None:
    b, t, hq, d = q.shape
    if k_pages.shape != v_pages.shape or k_pages.ndim != 4 or k_pages.shape[-1] != d:
        raise ValueError(f"paged_attention: k_pages {k_pages.shape} / v_pages {v_pages.shape} must be "
                         f"[P, S, Hkv, {d}]")
    if hq % k_pages.shape[2]:
        raise ValueError(f"paged_attention: Hq={hq} is not a multiple of Hkv={k_pages.shape[2]}")
    if page_table.shape[0] != b or q_positions.shape != (b, t) or kv_lengths.shape != (b,):
        raise ValueError(f"paged_attention: page_table {page_table.shape}, q_positions {q_positions.shape}, "
                         f"kv_lengths {kv_lengths.shape} do not match q {q.shape}")


def paged_attention_ref(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale: float):
    """Reference: gather each sequence's pages into a contiguous [Pmax*S] context, mask, softmax in f32."""
    _check(q, k_pages, v_pages, page_table, q_positions, kv_lengths)
    b, t, hq, d = q.shape
    _, s, hkv, _ = k_pages.shape
    n_ctx = page_table.shape[1] * s
    keys = k_pages[page_table].reshape(b, n_ctx, hkv, d)  # [B, N, Hkv, D]
    vals = v_pages[page_table].reshape(b, n_ctx, hkv, d)
    pos = jnp.arange(n_ctx, dtype=jnp.int32)
    valid = (pos[None, None, :] < kv_lengths[:, None, None]) & (pos[None, None, :] <= q_positions[:, :, None])
    vals = jnp.where((pos[None, :] < kv_lengths[:, None])[:, :, None, None], vals, 0)  # NaN-safe
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bnkd->bkgtn", qg, keys.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * scale
    scores = jnp.where(valid[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(valid[:, None, None], probs, 0.0)  # rows with no valid key give 0, not NaN
    o = jnp.einsum("bkgtn,bnkd->btkgd", probs, vals.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return o.reshape(b, t, hq, d).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tile config. block_k: keys per inner step (power of two >= 16). The number of key splits is
    NS = clamp(cdiv(target_programs, B*Hkv), 1, cdiv(Pmax*S, min_keys_per_split)) (static); a prefill's,
    with B*NQ programs per KV head, at least prefill_min_keys_per_split keys of the page table a split."""

    block_k: int = 64
    max_tile_bytes: int = 64 * 1024  # K+V tiles of one step; block_k shrinks to fit (f32 KV, big D)
    target_programs: int = 264  # two programs per SM on an H200 (132 SMs)
    min_keys_per_split: int = 128
    num_warps: int = 4
    num_stages: int = 2
    # More than max_block_queries query tokens (a prefill) run in blocks of prefill_rows // G tokens per
    # program (G query heads share a KV head), on prefill_num_warps warps; their keys split where the blocks
    # are fewer than target_programs (a 128-token serving piece: 7 blocks x 4 KV heads; 10 splits at 32k / 8k
    # context 1.55 -> 0.57 / 0.46 -> 0.22 ms a layer, H100, `--attention_prefill_tokens=128`; the key floor
    # below leaves 8 splits at 8k: 0.156 ms).
    # 128 rows x 8 warps: a 2048-token chunk at 8k / 32k context 1.07 / 4.31 ms (338 / 371 TFLOP/s) against
    # 2.48 / 10.73 at 32 x 4, the best of `--attention_cases=prefill` (H100).
    max_block_queries: int = 8
    prefill_rows: int = 128
    prefill_num_warps: int = 8
    # A prefill split writes a [prefill_rows, D] f32 partial tile (128 KiB at D 256) that the combine reads
    # back: 1024 keys of bf16 K and V (1 MiB) per split keep that at most 1/8 of its reads, and bound the
    # splits of a short prompt, most of them empty, where the page table is short (4 at 4k).
    prefill_min_keys_per_split: int = 1024
    # Keys per split, fixed (a multiple of every block_k: a power of two >= 64), for row-invariant
    # results; None: NS from target_programs and the split length from the sequence length.
    split_keys: int | None = None

    def __post_init__(self):
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"PagedAttentionConfig: block_k={self.block_k} must be a power of two >= 16")
        if self.target_programs < 1 or self.min_keys_per_split < 1 or self.prefill_min_keys_per_split < 1:
            raise ValueError(f"PagedAttentionConfig: target_programs and the min keys per split must be >= 1: {self}")
        if self.split_keys is not None and (self.split_keys < self.block_k or self.split_keys & (self.split_keys - 1)):
            raise ValueError(f"PagedAttentionConfig: split_keys={self.split_keys} must be a power of two >= "
                             f"block_k={self.block_k}")

    def keys_per_step(self, d: int, itemsize: int) -> int:
        fit = self.max_tile_bytes // (2 * d * itemsize)
        return max(16, min(self.block_k, 1 << max(0, fit.bit_length() - 1)))

    def num_splits(self, b: int, hkv: int, n_ctx: int, min_keys: int | None = None) -> int:
        """Key splits for b query blocks per KV head over a page table of n_ctx keys (min_keys: keys per
        split at least, default min_keys_per_split)."""
        if self.split_keys is not None:
            return -(-n_ctx // self.split_keys)
        want = -(-self.target_programs // (b * hkv))
        cap = -(-n_ctx // (self.min_keys_per_split if min_keys is None else min_keys))
        return max(1, min(want, cap))


DEFAULT_CONFIG = PagedAttentionConfig()
# 512 keys per split: a 4k context is 8 splits per KV head, 32k is 64 (256 programs at Hkv = 4, B = 1).
ROW_INVARIANT_CONFIG = PagedAttentionConfig(split_keys=512)
COMBINE_GROUP = 16  # splits added left to right per group; the groups then left to right
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _kernel(q_ref, k_ref, v_ref, pt_ref, qpos_ref, len_ref, acc_ref, m_ref, l_ref, *,
            g: int, t: int, t_block: int, rows: int, page_size: int, n_pages: int, n_ctx: int, n_splits: int,
            split_keys: int | None, block_k: int, scale_log2: float, precision):
    b, h = pl.program_id(0), pl.program_id(1)
    qb, s = jax.lax.div(pl.program_id(2), n_splits), jax.lax.rem(pl.program_id(2), n_splits)
    d = q_ref.shape[-1]
    kv_dtype = k_ref.dtype

    r = jax.lax.iota(jnp.int32, rows)
    r_t = qb * t_block + jax.lax.div(r, g)  # the row's query token
    row_ok = (r < g * t_block) & (r_t < t)
    r_t = jnp.where(row_ok, r_t, 0)
    r_h = h * g + jax.lax.rem(r, g)
    col = jax.lax.iota(jnp.int32, d)[None, :]  # gathers index every axis with arrays (interpret mode
    row_ok2 = jnp.broadcast_to(row_ok[:, None], (rows, d))  # cannot mix array indices and slices)
    q = plgpu.load(q_ref.at[b, r_t[:, None], r_h[:, None], col], mask=row_ok2, other=0.0).astype(kv_dtype)
    q_pos = plgpu.load(qpos_ref.at[b, r_t], mask=row_ok, other=-1)  # [R]; padding rows see no key

    cdiv = lambda a, c: jax.lax.div(a + (c - 1), c)  # a >= 0
    # keys [0, n) of this sequence, none past the block's last query (causal)
    n = jnp.minimum(jnp.clip(len_ref[b], 0, n_ctx), jnp.max(q_pos) + 1)
    split_len = split_keys if split_keys is not None else cdiv(cdiv(n, n_splits), block_k) * block_k
    start = s * split_len
    end = jnp.minimum(start + split_len, n)
    n_blocks = cdiv(jnp.maximum(end - start, 0), block_k)  # dynamic: 0 for splits past the length

    def body(i, carry):
        acc, m, l = carry
        j = start + i * block_k + jax.lax.iota(jnp.int32, block_k)  # key positions [BK]
        key_ok = j < end
        page = plgpu.load(pt_ref.at[b, jax.lax.div(j, page_size)], mask=key_ok, other=0)
        page = jnp.clip(page, 0, n_pages - 1)
        slot = jax.lax.rem(j, page_size)
        key_ok2 = jnp.broadcast_to(key_ok[:, None], (block_k, d))
        k = plgpu.load(k_ref.at[page[:, None], slot[:, None], h, col], mask=key_ok2, other=0.0)  # [BK, D]
        v = plgpu.load(v_ref.at[page[:, None], slot[:, None], h, col], mask=key_ok2, other=0.0)
        sc = plgpu.dot(q, k, trans_b=True, precision=precision) * scale_log2  # [R, BK] f32
        valid = key_ok[None, :] & (j[None, :] <= q_pos[:, None])
        sc = jnp.where(valid, sc, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no valid key yet: keep exp2 finite
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(sc - m_safe[:, None])  # exactly 0 where masked
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(kv_dtype), v, precision=precision)
        return acc, m_new, l

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, n_blocks, body, init)
    plgpu.store(acc_ref, acc)
    plgpu.store(m_ref, m)
    plgpu.store(l_ref, l)


def _validate(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale, config) -> None:
    for name, a, nd in (("q", q, 4), ("k_pages", k_pages, 4), ("v_pages", v_pages, 4),
                        ("page_table", page_table, 2), ("q_positions", q_positions, 2),
                        ("kv_lengths", kv_lengths, 1)):
        if getattr(a, "ndim", None) != nd:
            raise ValueError(f"paged_attention: {name} must have {nd} dims, got shape {getattr(a, 'shape', a)}")
    _check(q, k_pages, v_pages, page_table, q_positions, kv_lengths)
    for name, a in (("page_table", page_table), ("q_positions", q_positions), ("kv_lengths", kv_lengths)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"paged_attention: {name} must be an integer array, got {a.dtype}")
    for name, a in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if jnp.dtype(a.dtype) not in _FLOATS:
            raise ValueError(f"paged_attention: {name} dtype {a.dtype} not in float32/bfloat16/float16")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"paged_attention: k_pages {k_pages.dtype} and v_pages {v_pages.dtype} differ")
    b, t, _, d = q.shape
    if min(b, t, *k_pages.shape[:3], page_table.shape[1]) < 1:
        raise ValueError(f"paged_attention: empty axis in q {q.shape}, pages {k_pages.shape}, "
                         f"page_table {page_table.shape}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"paged_attention: head dim D={d} must be a power of two >= 16 (Triton tiles)")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise ValueError(f"paged_attention: scale must be a Python float (static), got {type(scale).__name__}")
    if not isinstance(config, PagedAttentionConfig):
        raise ValueError(f"paged_attention: config must be a PagedAttentionConfig, got {type(config).__name__}")


def paged_attention(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale: float, *,
                    interpret: bool = False, config: PagedAttentionConfig | None = None):
    """Pallas paged attention with the semantics of `paged_attention_ref` (see the module docstring)."""
    config = DEFAULT_CONFIG if config is None else config
    _validate(q, k_pages, v_pages, page_table, q_positions, kv_lengths, scale, config)
    return _paged_attention(q, k_pages, v_pages, page_table.astype(jnp.int32), q_positions.astype(jnp.int32),
                            kv_lengths.astype(jnp.int32), scale=float(scale), interpret=bool(interpret),
                            config=config)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config"))
def _paged_attention(q, k_pages, v_pages, page_table, q_positions, kv_lengths, *, scale, interpret, config):
    b, t, hq, d = q.shape
    n_pages, page_size, hkv, _ = k_pages.shape
    g = hq // hkv
    t_block = t if t <= config.max_block_queries else min(t, max(1, config.prefill_rows // g))  # per program
    n_qblocks = -(-t // t_block)
    rows = max(16, next_pow2(g * t_block))
    n_ctx = page_table.shape[1] * page_size
    if n_qblocks == 1:
        n_splits = config.num_splits(b, hkv, n_ctx)
    else:  # few query blocks over a long context (a serving piece) split their keys as a decode does
        n_splits = 1 if config.split_keys is not None else config.num_splits(b * n_qblocks, hkv, n_ctx,
                                                                                config.prefill_min_keys_per_split)
    block_k = config.keys_per_step(d, jnp.dtype(k_pages.dtype).itemsize)
    f32 = jnp.dtype(jnp.float32)
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(k_pages.dtype) == f32 else None
    kernel = functools.partial(
        _kernel, g=g, t=t, t_block=t_block, rows=rows, page_size=page_size, n_pages=n_pages, n_ctx=n_ctx, n_splits=n_splits,
        split_keys=config.split_keys if n_qblocks == 1 else None, block_k=block_k, scale_log2=scale * math.log2(math.e), precision=precision)
    full = lambda a: pl.BlockSpec(a.shape, lambda i, j, k: (0,) * a.ndim)  # the whole array, indexed inside
    (q, k_pages, v_pages, page_table, q_positions, kv_lengths), out = align(
        q, k_pages, v_pages, page_table, q_positions, kv_lengths)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_qblocks * n_splits),
        in_specs=[full(q), full(k_pages), full(v_pages), full(page_table), full(q_positions), full(kv_lengths)],
        out_specs=[pl.BlockSpec((None, None, None, rows, d), lambda i, j, k: (i, j, k, 0, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, j, k: (i, j, k, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda i, j, k: (i, j, k, 0))],
        out_shape=[out((b, hkv, n_qblocks * n_splits, rows, d), jnp.float32),
                   out((b, hkv, n_qblocks * n_splits, rows), jnp.float32),
                   out((b, hkv, n_qblocks * n_splits, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(
            num_warps=config.prefill_num_warps if n_qblocks > 1 else config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="paged_attention",
    )(q, k_pages, v_pages, page_table, q_positions, kv_lengths)
    acc = acc.reshape(b, hkv, n_qblocks, n_splits, rows, d)
    m, l = (x.reshape(b, hkv, n_qblocks, n_splits, rows) for x in (m, l))
    if n_splits == 1:
        l_tot, acc_tot = l[:, :, :, 0], acc[:, :, :, 0]
    else:  # combine the splits: weights exp2(m_s - max_s m_s); empty splits have m = -inf -> weight 0
        m_max = jnp.max(m, axis=3, keepdims=True)
        w = jnp.exp2(m - jnp.where(m_max == -jnp.inf, 0.0, m_max))  # [B, Hkv, NQ, NS, R]
        if config.split_keys is None:
            l_tot = jnp.sum(w * l, axis=3)  # [B, Hkv, NQ, R]
            acc_tot = jnp.sum(w[..., None] * acc, axis=3)  # [B, Hkv, NQ, R, D]
        else:  # one query block
            l_tot = _sum_splits_in_order((w * l)[:, :, 0])[:, :, None]
            acc_tot = _sum_splits_in_order((w[..., None] * acc)[:, :, 0])[:, :, None]
    o = jnp.where(l_tot[..., None] > 0, acc_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None], 0.0)
    # [B, Hkv, NQ, R, D] -> the query blocks' rows in token order
    o = o[:, :, :, :g * t_block].reshape(b, hkv, n_qblocks * t_block, g, d)[:, :, :t]
    return o.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d).astype(q.dtype)


def _sum_splits_in_order(x: jax.Array) -> jax.Array:
    """Sum over axis 2 (the splits) of x [B, Hkv, NS, ...] in an order fixed by position alone: left to
    right within groups of COMBINE_GROUP splits, then the group sums left to right. Splits appended as
    zeros leave every sum's bits unchanged, so the result does not depend on NS (XLA's reduce picks its
    order from the shape)."""
    ns = x.shape[2]
    n_groups = -(-ns // COMBINE_GROUP)
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, n_groups * COMBINE_GROUP - ns)
    x = jnp.pad(x, pad).reshape(x.shape[:2] + (n_groups, COMBINE_GROUP) + x.shape[3:])
    groups = x[:, :, :, 0]
    for i in range(1, COMBINE_GROUP):  # [B, Hkv, NG, ...]
        groups = groups + x[:, :, :, i]
    total = groups[:, :, 0]
    for i in range(1, n_groups):
        total = total + groups[:, :, i]
    return total
