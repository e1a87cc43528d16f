"""Gated DeltaNet decode / verify from the raw in_proj_qkv output: causal conv, SiLU, q/k L2 norm, gates,
padding and the gated delta rule in one kernel (MODEL_SPEC §3.6 steps 2-7). Per sequence, with u_t =
mixed[t] (channels q | k | v, C = 2 Hk Dk + Hv Dv) and the window [conv_state (W-1 rows) | u_0 .. u_{T-1}]:

    y_t[c] = silu( sum_{i<W} w[c, i] * window[t + i][c] )       (tap W-1 multiplies u_t)
    q_t = l2(y_t[q channels of key head]) * scale,   k_t = l2(y_t[k channels]),   l2(x) = x rsqrt(x.x + 1e-6)
    v_t = y_t[v channels of value head]
    beta_t = sigmoid(b_t),  g_t = -exp(A_log) softplus(a_t + dt_bias)
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t      (value head h, key head h // r)

for tokens t < n_valid; padding tokens (t >= n_valid) keep S and the conv state by a select (NaN cannot reach
them; their o_t is meaningless). The new conv state is window[n_valid + i], i < W-1.

Shapes: mixed [B, T, C]; conv_state [B, W-1, C] (rounded to mixed's dtype before the conv, as the model's);
conv_w [C, W]; a, b [B, T, Hv] or ba [B, T, 2 Hv] = [b | a] (in_proj_ba's output read in place: no slice
between the projection and the kernel); A_log, dt_bias [Hv]; state [B, Hv, Dk, Dv] f32; n_valid [B] int in
[0, T] -> (o [B, T, Hv, Dv] f32, state f32, conv state in conv_state's dtype). Slotted (speculative verify):
slots int [B], state [Ns, B, Hv, Dk, Dv] and conv_state [Ns, B, W-1, C] (Ns >= T + 1); row b reads slot
slots[b], the states after token t go to slot (slots[b] + 1 + t) mod Ns: a commit is an index (`next_slots`).

Kernel grid (B, Hv, Dv / BV): program (b, h, j) keeps the f32 tile S[b, h, :, j BV:(j+1) BV] in registers
(S's Dv columns evolve independently) and convolves its own q, k (key head h // r) and BV v channels, so the
layer runs in_proj -> this kernel -> gated norm -> out_proj. A state step reads S_{t-1} once for S^T k and
S^T q side by side: o_t = exp(g_t) S_{t-1}^T q_t + (k_t . q_t) beta_t u_t, u_t = v_t - exp(g_t) S_{t-1}^T k_t.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gdn
from pallas_kernels._vma import align
from pallas_kernels.fp8_config import is_pow2

F32 = jnp.float32
L2_EPS = 1e-6  # MODEL_SPEC §3.6 step 6 (FLA convention)
MAX_UNROLLED_TOKENS = 8  # a decode / verify pass (T <= K+1) is unrolled; longer inputs loop over tokens


@dataclasses.dataclass(frozen=True)
class RecurrenceConfig:
    """block_v Dv columns of the state per program (a power of two, shrunk to divide Dv); one stage: no loop to
    pipeline. 32 x 4: the fastest of the tile sweep at the 27B shapes."""

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1


RECURRENCE_CONFIG = RecurrenceConfig()


def _check(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, key_heads: int) -> None:
    bsz, t, c = mixed.shape
    if state.ndim != 4 or state.shape[0] != bsz:
        raise ValueError(f"gdn conv: state {state.shape} must be [B, Hv, Dk, Dv] with B = {bsz}")
    hv, dk, dv = state.shape[1:]
    if key_heads < 1 or hv % key_heads or c != 2 * key_heads * dk + hv * dv:
        raise ValueError(f"gdn conv: mixed has C = {c} channels; key_heads = {key_heads} with state {state.shape} "
                         f"needs C = 2 Hk Dk + Hv Dv = {2 * key_heads * dk + hv * dv} and Hk | Hv")
    if conv_w.ndim != 2 or conv_w.shape[0] != c or conv_w.shape[1] < 2:
        raise ValueError(f"gdn conv: conv_w {conv_w.shape} must be [C, W] = [{c}, W >= 2]")
    width = conv_w.shape[1]
    if conv_state.shape != (bsz, width - 1, c):
        raise ValueError(f"gdn conv: conv_state {conv_state.shape} must be [B, W-1, C] = {(bsz, width - 1, c)}")
    if a.shape != (bsz, t, hv) or b.shape != (bsz, t, hv):
        raise ValueError(f"gdn conv: a {a.shape}, b {b.shape} must be [B, T, Hv] = {(bsz, t, hv)}")
    if a_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"gdn conv: A_log {a_log.shape}, dt_bias {dt_bias.shape} must be [Hv] = {(hv,)}")
    if n_valid.shape != (bsz,) or not jnp.issubdtype(n_valid.dtype, jnp.integer):
        raise ValueError(f"gdn conv: n_valid {n_valid.shape} {n_valid.dtype} must be integer [B] = {(bsz,)}")
    for name, x in (("mixed", mixed), ("conv_state", conv_state), ("conv_w", conv_w), ("a", a), ("b", b),
                    ("A_log", a_log), ("dt_bias", dt_bias), ("state", state)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"gdn conv: {name} has dtype {x.dtype}; floating point needed")


def _l2(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _gates(a, b, ba, hv: int):
    """(a, b) from either form: a and b [B, T, Hv], or ba [B, T, 2 Hv] = [b | a] (split here)."""
    if (ba is None) == (a is None or b is None):
        raise ValueError("gdn conv: pass the gate projections either as a and b or as ba, not both or neither")
    if ba is None:
        return a, b
    if ba.ndim != 3 or ba.shape[-1] != 2 * hv:
        raise ValueError(f"gdn conv: ba {ba.shape} must be [B, T, 2 Hv] = [..., {2 * hv}] ([b | a])")
    return ba[..., hv:], ba[..., :hv]


def read_slot(slotted: jax.Array, slots: jax.Array) -> jax.Array:
    """slotted [Ns, B, ...] -> [B, ...]: row b's slot slots[b] (the state a slotted row is read from)."""
    return slotted[slots, jnp.arange(slotted.shape[1])]


def write_slots(slotted: jax.Array, slots: jax.Array, value: jax.Array) -> jax.Array:
    """slotted [Ns, B, ...] with row b's slot slots[b] replaced by value[b] (in place when donated)."""
    return slotted.at[slots, jnp.arange(slotted.shape[1])].set(value.astype(slotted.dtype))


def next_slots(slots: jax.Array, n_keep: jax.Array, n_slots: int) -> jax.Array:
    """The slot of each row's state after its first n_keep [B] tokens of a slotted call that read `slots`."""
    return ((slots + n_keep) % n_slots).astype(jnp.int32)


def _check_slots(state, conv_state, slots, t: int) -> None:
    if state.ndim != 5 or conv_state.ndim != 4 or conv_state.shape[:2] != state.shape[:2]:
        raise ValueError(f"gdn conv: with slots, state {state.shape} and conv_state {conv_state.shape} must be "
                         "slotted [Ns, B, Hv, Dk, Dv] and [Ns, B, W-1, C]")
    if state.shape[0] < t + 1:
        raise ValueError(f"gdn conv: {state.shape[0]} state slots hold the read state and T = {t} per-token "
                         f"states only if Ns >= T + 1 = {t + 1}")
    if slots.shape != state.shape[1:2] or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"gdn conv: slots {slots.shape} {slots.dtype} must be int [B] = {state.shape[1:2]} "
                         "(each row's read slot)")


def gdn_conv_recurrence_ref(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, *,
                            key_heads: int, scale: float, ba=None, slots=None):
    """The unfused pieces composed (causal conv, split, L2 norms, `gdn.gdn_gates_ref`, padding mask,
    `gdn.gdn_recurrence_ref`). Slotted: the states after the first min(t + 1, n_valid) tokens go to slot
    (slots[b] + 1 + t) mod Ns, t < T; the other slots stay as they were."""
    if slots is None:
        o, final, new_conv, _ = _conv_recurrence_ref(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid,
                                                     key_heads=key_heads, scale=scale, ba=ba)
        return o, final, new_conv
    _check_slots(state, conv_state, slots, mixed.shape[1])
    o, _, _, (states, convs) = _conv_recurrence_ref(
        mixed, read_slot(conv_state, slots), conv_w, a, b, a_log, dt_bias, read_slot(state, slots), n_valid,
        key_heads=key_heads, scale=scale, ba=ba, per_token=True)
    for t in range(mixed.shape[1]):
        written = (slots + 1 + t) % state.shape[0]
        state, conv_state = write_slots(state, written, states[:, t]), write_slots(conv_state, written, convs[:, t])
    return o, state, conv_state


def _conv_recurrence_ref(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, *, key_heads: int,
                         scale: float, ba=None, per_token: bool = False):
    """(o, state, conv state, per_token: (states [B, T, Hv, Dk, Dv], convs [B, T, W-1, C]), else None)."""
    a, b = _gates(a, b, ba, state.shape[1] if state.ndim == 4 else 0)
    _check(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, key_heads)
    bsz, t, _ = mixed.shape
    hv, dk, dv = state.shape[1:]
    width = conv_w.shape[1]
    window = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)  # [B, W-1+T, C]
    w32 = conv_w.astype(F32)
    y = jax.nn.silu(sum(window[:, i:i + t].astype(F32) * w32[:, i] for i in range(width)))  # [B, T, C]
    conv_after = lambda n: jnp.take_along_axis(  # noqa: E731  window rows n .. n+W-2: the conv state after n tokens
        window, (n[:, None] + jnp.arange(width - 1)[None])[:, :, None], axis=1).astype(conv_state.dtype)
    key_dim = key_heads * dk
    q = _l2(y[..., :key_dim].reshape(bsz, t, key_heads, dk)) * scale  # [B, T, Hk, Dk]
    k = _l2(y[..., key_dim:2 * key_dim].reshape(bsz, t, key_heads, dk))
    v = y[..., 2 * key_dim:].reshape(bsz, t, hv, dv)  # [B, T, Hv, Dv]
    g, beta = gdn.gdn_gates_ref(a, b, a_log, dt_bias)
    valid = jnp.arange(t)[None] < n_valid[:, None]  # [B, T]; padding: g = beta = k = v = 0, an exact identity
    g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
    k, v = jnp.where(valid[..., None, None], k, 0.0), jnp.where(valid[..., None, None], v, 0.0)
    if not per_token:
        o, final = gdn.gdn_recurrence_ref(q, k, v, g, beta, state)
        return o, final, conv_after(n_valid), None
    o, final, states = gdn.gdn_recurrence_ref(q, k, v, g, beta, state, return_states=True)
    convs = jnp.stack([conv_after(jnp.minimum(n_valid, i + 1)) for i in range(t)], axis=1)  # [B, T, W-1, C]
    return o, final, conv_after(n_valid), (states, convs)


def _conv_kernel(mixed_ref, conv_ref, w_ref, a_ref, b_ref, alog_ref, dtb_ref, n_ref, s_ref, slot_ref,
                 o_ref, s_out_ref, conv_out_ref, *, n_tokens: int, key_heads: int, r: int, dv: int, scale: float,
                 n_slots: int = 0, token_loop: bool = False):
    # mixed_ref [T, C], conv refs [W-1, C], w_ref [C, W] come whole along C: a program reads and writes its
    # channel slices one [Dk] or [BV] row at a time (Triton tensors are powers of two; W-1 = 3 rows are not).
    # a_ref, b_ref [T]; s refs [Dk, BV]; o_ref [T, BV]. Slotted: [Ns, ...], aliased; never writing the read slot,
    # no program reads what another wrote. `prev`: the W-1 inputs before token t; `kept`: selected as the state.
    dk, bv = s_ref.shape[-2:]
    width = w_ref.shape[1]
    ih, iv = pl.program_id(1), pl.program_id(2)
    kh = ih // r
    groups = ((kh * dk, dk), ((key_heads + kh) * dk, dk), (2 * key_heads * dk + ih * dv + iv * bv, bv))  # q, k, v
    taps = tuple(tuple(w_ref[pl.ds(off, n), i].astype(F32) for i in range(width)) for off, n in groups)
    rnd = lambda x: x.astype(mixed_ref.dtype).astype(F32)  # the conv state joins the window in mixed's dtype
    read = slot_ref[()] if n_slots else None
    conv_in = (lambda i, off, n: conv_ref[read, i, pl.ds(off, n)]) if n_slots else (
        lambda i, off, n: conv_ref[i, pl.ds(off, n)])
    prev0 = tuple(tuple(rnd(conv_in(i, off, n)) for i in range(width - 1)) for off, n in groups)
    decay = -jnp.exp(alog_ref[()].astype(F32))
    dt_bias = dtb_ref[()].astype(F32)
    n_valid = n_ref[()]
    # the q and k conv rows of a key head: all its programs compute them, one (h % r == 0, j == 0) stores them
    # (no racing stores); so, unslotted, the conv-state output must not alias conv_state (later programs read it).
    owns_qk = (ih % r == 0) & (iv == 0)

    def store_conv(kept, slot=None):
        def rows(group):
            off, n = groups[group]
            for i in range(width - 1):
                value = kept[group][i].astype(conv_out_ref.dtype)
                if slot is None:
                    conv_out_ref[i, pl.ds(off, n)] = value
                else:
                    conv_out_ref[slot, i, pl.ds(off, n)] = value

        rows(2)  # the v slice belongs to this program alone

        @pl.when(owns_qk)
        def _():
            rows(0)
            rows(1)

    def slot_of(t):
        return (read + 1 + t) % n_slots

    def load(t):
        """Token t's raw rows (one [n] per group) and gate logits."""
        return tuple(mixed_ref[t, pl.ds(off, n)].astype(F32) for off, n in groups), a_ref[t], b_ref[t]

    def inputs(t, raw, prev, kept):
        """Token t's conv, norms and gates: ((q_t, k_t [Dk], v_t [BV], g_t, beta_t, valid), prev, kept)."""
        rows_t, a_t, b_t = raw
        ys, shifted = [], []
        for w, rows, u in zip(taps, prev, rows_t):
            window = rows + (u,)  # W rows [n], the oldest first
            ys.append(jax.nn.silu(sum(window[i] * w[i] for i in range(width))))  # the ref's order of the sum
            shifted.append(window[1:])
        valid = t < n_valid
        kept = tuple(tuple(jnp.where(valid, row, old_row) for row, old_row in zip(rows, old_rows))
                     for rows, old_rows in zip(shifted, kept))
        x = a_t.astype(F32) + dt_bias
        softplus = jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))
        beta = 1.0 / (1.0 + jnp.exp(-b_t.astype(F32)))
        return (_l2(ys[0]) * scale, _l2(ys[1]), ys[2], decay * softplus, beta, valid), tuple(shifted), kept

    def step(t, x, s):
        """Token t's state step from S_{t-1} (one reduction step: S^T k and S^T q side by side)."""
        q_t, k_t, v_t, g_t, beta, valid = x
        gamma = jnp.exp(g_t)
        sk = jnp.sum(s * k_t[:, None], axis=0)  # [BV]
        sq = jnp.sum(s * q_t[:, None], axis=0)
        bu = beta * (v_t - gamma * sk)
        o_ref[t, :] = (gamma * sq + jnp.sum(q_t * k_t) * bu).astype(o_ref.dtype)
        s = jnp.where(valid, s * gamma + k_t[:, None] * bu[None, :], s)  # padding: the old bits
        if n_slots:  # token t's state to slot (read + 1 + t) mod Ns
            s_out_ref[slot_of(t)] = s.astype(s_out_ref.dtype)
        return s

    s = (s_ref[read] if n_slots else s_ref[...]).astype(F32)
    prev = kept = prev0  # per group, W-1 rows [n] f32
    if n_tokens <= MAX_UNROLLED_TOKENS and not token_loop:  # all loads, then conv, norms and gates, then the chain
        raws = [load(t) for t in range(n_tokens)]
        xs, kept_after = [], []
        for t in range(n_tokens):
            x, prev, kept = inputs(t, raws[t], prev, kept)
            xs.append(x)
            kept_after.append(kept)
        if n_slots:  # every token's conv rows before the chain: its steps keep only their state stores
            for t in range(n_tokens):
                store_conv(kept_after[t], slot_of(t))
        for t in range(n_tokens):
            s = step(t, xs[t], s)
    else:
        def token(t, carry):
            s, prev, kept = carry
            x, prev, kept = inputs(t, load(t), prev, kept)
            if n_slots:
                store_conv(kept, slot_of(t))
            return step(t, x, s), prev, kept

        # token_loop: a trip count the compiler cannot see (n_valid <= T), so it neither drops a one-token loop
        # nor unrolls a short one: every T runs this body as it is
        upper = jnp.maximum(n_valid, n_tokens) if token_loop else n_tokens
        s, _, kept = jax.lax.fori_loop(0, upper, token, (s, prev, kept))
    if not n_slots:  # slotted, every token's state is out already
        s_out_ref[...] = s.astype(s_out_ref.dtype)
        store_conv(kept)


def gdn_conv_recurrence(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, *, key_heads: int,
                        scale: float, interpret: bool = False, config: RecurrenceConfig | None = None,
                        in_place: bool = True, ba=None, slots=None, row_invariant: bool = False):
    """Pallas twin of `gdn_conv_recurrence_ref`; Dk a power of two. in_place: the state output aliases the f32
    state input (XLA copies it where the caller still needs it); the conv state is a new buffer (see the
    kernel). ba goes in twice (block index maps h and Hv + h). Slotted (f32, in_place): both in place.
    row_invariant: every T runs one per-token loop body, so token t's bits do not depend on how many tokens
    share the launch (a decode step's row equals the same row of a verify pass); unrolled, each T's program
    is laid out and scheduled on its own by the compiler."""
    return _gdn_conv_recurrence(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, ba, slots,
                                key_heads=key_heads, scale=float(scale), interpret=interpret,
                                config=config or RECURRENCE_CONFIG, in_place=in_place, row_invariant=row_invariant)


# jitted: the 48 GDN layers of a pass trace and lower the kernel once (as fp8_matmul._decode_launch)
@functools.partial(jax.jit, static_argnames=("key_heads", "scale", "interpret", "config", "in_place",
                                             "row_invariant"))
def _gdn_conv_recurrence(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, ba, slots, *,
                         key_heads: int, scale: float, interpret: bool, config: RecurrenceConfig, in_place: bool,
                         row_invariant: bool):
    slotted_state = slotted_conv = None
    if slots is not None:
        _check_slots(state, conv_state, slots, mixed.shape[1])
        if state.dtype != F32 or not in_place:
            raise ValueError(f"gdn_conv_recurrence: a slotted state must be f32 ({state.dtype}) and in place")
        slotted_state, slotted_conv, state, conv_state = state, conv_state, state[0], conv_state[0]
    # the shapes are checked on one slot and on ba's halves (slices nothing uses: traced, then dropped)
    _check(mixed, conv_state, conv_w, *_gates(a, b, ba, state.shape[1] if state.ndim == 4 else 0), a_log, dt_bias,
           state, n_valid, key_heads)
    bsz, t, c = mixed.shape
    hv, dk, dv = state.shape[1:]
    width = conv_w.shape[1]
    if not is_pow2(dk):
        raise ValueError(f"gdn_conv_recurrence: Dk = {dk} must be a power of two (Triton tensor sizes)")
    if not is_pow2(config.block_v) or config.num_warps < 1 or config.num_stages < 1:
        raise ValueError(f"gdn_conv_recurrence: bad config {config}: block_v must be a power of two, "
                         "num_warps and num_stages >= 1")
    bv = min(config.block_v, dv & -dv)  # the largest power of two <= block_v dividing Dv
    if t == 0:
        if slots is not None:
            return jnp.zeros((bsz, 0, hv, dv), F32), slotted_state, slotted_conv
        return jnp.zeros((bsz, 0, hv, dv), F32), state.astype(F32), conv_state
    sq = pl.squeezed
    row_spec = lambda rows: pl.BlockSpec((sq, rows, c), lambda ib, ih, iv: (ib, 0, 0))  # [rows, C] of sequence b
    tv_spec = pl.BlockSpec((sq, t, sq, bv), lambda ib, ih, iv: (ib, 0, ih, iv))
    a_offset = 0 if ba is None else hv  # the block index of a's head h: h, or Hv + h inside ba = [b | a]
    a_spec = pl.BlockSpec((sq, t, sq), lambda ib, ih, iv: (ib, 0, a_offset + ih))
    b_spec = pl.BlockSpec((sq, t, sq), lambda ib, ih, iv: (ib, 0, ih))
    head_spec = pl.BlockSpec((sq,), lambda ib, ih, iv: (ih,))
    batch_spec = pl.BlockSpec((sq,), lambda ib, ih, iv: (ib,))
    w_spec = pl.BlockSpec((c, width), lambda ib, ih, iv: (0, 0))
    if slots is None:
        s_spec = pl.BlockSpec((sq, sq, dk, bv), lambda ib, ih, iv: (ib, ih, 0, iv))
        conv_spec = row_spec(width - 1)
        state, slots, n_slots = state.astype(F32), jnp.zeros((bsz,), jnp.int32), 0  # slots unread
        aliases = {8: 1} if in_place else {}
    else:
        n_slots = slotted_state.shape[0]
        s_spec = pl.BlockSpec((n_slots, sq, sq, dk, bv), lambda ib, ih, iv: (0, ib, ih, 0, iv))
        conv_spec = pl.BlockSpec((n_slots, sq, width - 1, c), lambda ib, ih, iv: (0, ib, 0, 0))
        state, conv_state = slotted_state, slotted_conv
        aliases = {1: 2, 8: 1}
    kernel = functools.partial(_conv_kernel, n_tokens=t, key_heads=key_heads, r=hv // key_heads, dv=dv,
                               scale=float(scale), n_slots=n_slots, token_loop=row_invariant)
    if ba is not None:
        a = b = ba
    args, out = align(mixed, conv_state, conv_w, a, b, a_log, dt_bias, n_valid.astype(jnp.int32), state,
                      slots.astype(jnp.int32))
    return pl.pallas_call(
        kernel,
        out_shape=(out((bsz, t, hv, dv), F32), out(state.shape, F32), out(conv_state.shape, conv_state.dtype)),
        grid=(bsz, hv, dv // bv),
        in_specs=[row_spec(t), conv_spec, w_spec, a_spec, b_spec, head_spec, head_spec,
                  batch_spec, s_spec, batch_spec],
        out_specs=[tv_spec, s_spec, conv_spec],
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gdn_conv_recurrence",
    )(*args)
