"""Gated DeltaNet decode / verify from the raw in_proj_qkv output: causal conv, SiLU, q/k L2 norm,
gates, padding and the gated delta rule in one kernel (MODEL_SPEC §3.6 steps 2-7).

Per sequence, with u_t = mixed[t] (the raw in_proj_qkv output, channels q | k | v, C = 2 Hk Dk +
Hv Dv) and the window [conv_state (W-1 rows) | u_0 .. u_{T-1}]:

    y_t[c] = silu( sum_{i<W} w[c, i] * window[t + i][c] )       (tap W-1 multiplies u_t)
    q_t = l2(y_t[q channels of key head]) * scale,   k_t = l2(y_t[k channels]),   l2(x) = x rsqrt(x.x + 1e-6)
    v_t = y_t[v channels of value head]
    beta_t = sigmoid(b_t),  g_t = -exp(A_log) softplus(a_t + dt_bias)
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t      (value head h, key head h // r)

for tokens t < n_valid; tokens t >= n_valid are padding: they change neither S nor the conv state
(a select, so NaN inputs cannot reach either; their o_t is meaningless). The new conv state is
window[n_valid + i], i < W-1: the last W-1 inputs up to the last valid token, reaching back into the
old conv state when n_valid < W-1 (qmtp.layers.conv_window_state).

Shapes: mixed [B, T, C]; conv_state [B, W-1, C]; conv_w [C, W]; a, b [B, T, Hv] (or, instead, the keyword
ba [B, T, 2 Hv] = [b | a]: the output of one projection through both weights, qmtp.api's in_proj_ba,
read in place, so no slice of it runs between the projection and the kernel); A_log, dt_bias [Hv];
state [B, Hv, Dk, Dv] f32; n_valid [B] int in [0, T]. Returns (o [B, T, Hv, Dv] f32, state [B, Hv, Dk,
Dv] f32, conv state [B, W-1, C] in conv_state's dtype). The conv state is rounded to mixed's dtype
before the conv, as qmtp.layers.causal_conv does.

- `gdn_conv_recurrence_ref`: the jnp twin, the composition of the unfused pieces (causal conv, split,
  L2 norms, `gdn.gdn_recurrence_gated_ref`).
- `gdn_conv_recurrence`: the Pallas kernel (Triton lowering; `interpret=True` on the CPU). Grid
  (B, Hv, Dv / BV) as `gdn.gdn_recurrence_gated`: program (b, h, j) holds the f32 state tile
  S[b, h, :, j BV:(j+1) BV] [Dk, BV] and convolves, for its tokens, the Dk q and Dk k channels of key
  head h // r and its BV v channels (each from the W-1 conv-state rows and the T raw rows), so the
  layer runs in_proj -> this kernel -> gated norm -> out_proj with no XLA op between.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gdn
from pallas_kernels._vma import align

F32 = jnp.float32
L2_EPS = 1e-6  # MODEL_SPEC §3.6 step 6 (FLA convention)


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
    gdn.check_gate_inputs("gdn conv", a, b, a_log, dt_bias, n_valid, bsz, t, hv)
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


def read_half(pair: jax.Array, halves: jax.Array) -> jax.Array:
    """pair [2, ...][halves[0]]: the half a double-buffered state is read from."""
    return jax.lax.dynamic_index_in_dim(pair, halves[0], axis=0, keepdims=False)


def write_half(pair: jax.Array, halves: jax.Array, value: jax.Array) -> jax.Array:
    """pair with half halves[1] replaced by value (in place when pair is donated)."""
    return jax.lax.dynamic_update_index_in_dim(pair, value.astype(pair.dtype), halves[1], axis=0)


def _check_halves(state, halves) -> None:
    if state.ndim != 5 or state.shape[0] != 2:
        raise ValueError(f"gdn conv: with halves, state {state.shape} must be a pair [2, B, Hv, Dk, Dv]")
    if halves.shape != (2,) or not jnp.issubdtype(halves.dtype, jnp.integer):
        raise ValueError(f"gdn conv: halves {halves.shape} {halves.dtype} must be int [2] = (read, write)")


def gdn_conv_recurrence_ref(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, *,
                            key_heads: int, scale: float, ba=None, halves=None):
    """The unfused pieces composed (the same jnp as qmtp.layers.causal_conv / l2_normalize):
    -> (o [B, T, Hv, Dv] f32, state [B, Hv, Dk, Dv] f32, conv state [B, W-1, C]). With halves = (read,
    write) int [2], state is a double-buffered pair [2, B, Hv, Dk, Dv]: the recurrence starts from
    state[read] and the returned pair holds its result in half `write` (the other half as it was)."""
    if halves is not None:
        _check_halves(state, halves)
        o, final, conv = gdn_conv_recurrence_ref(mixed, conv_state, conv_w, a, b, a_log, dt_bias,
                                                 read_half(state, halves), n_valid, key_heads=key_heads,
                                                 scale=scale, ba=ba)
        return o, write_half(state, halves, final), conv
    a, b = _gates(a, b, ba, state.shape[1] if state.ndim == 4 else 0)
    _check(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, key_heads)
    bsz, t, _ = mixed.shape
    hv, dk, dv = state.shape[1:]
    width = conv_w.shape[1]
    window = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)  # [B, W-1+T, C]
    w32 = conv_w.astype(F32)
    y = jax.nn.silu(sum(window[:, i:i + t].astype(F32) * w32[:, i] for i in range(width)))  # [B, T, C]
    idx = n_valid[:, None] + jnp.arange(width - 1)[None]  # [B, W-1]: window rows of the new conv state
    new_conv = jnp.take_along_axis(window, idx[:, :, None], axis=1).astype(conv_state.dtype)
    key_dim = key_heads * dk
    q = _l2(y[..., :key_dim].reshape(bsz, t, key_heads, dk)) * scale  # [B, T, Hk, Dk]
    k = _l2(y[..., key_dim:2 * key_dim].reshape(bsz, t, key_heads, dk))
    v = y[..., 2 * key_dim:].reshape(bsz, t, hv, dv)  # [B, T, Hv, Dv]
    o, final = gdn.gdn_recurrence_gated_ref(q, k, v, a, b, a_log, dt_bias, state, n_valid)
    return o, final, new_conv


# ----------------------------------------------------------------------------------------------
# Pallas kernel. mixed, conv_state, conv_w and the conv-state output are passed whole along C (one
# block per sequence); each program reads and writes only its channel slices with pl.ds offsets
# from its program ids (q: (h // r) Dk, k: Hk Dk + (h // r) Dk, v: 2 Hk Dk + h Dv + j BV), one
# [Dk] or [BV] row at a time (Triton tensors must have power-of-two sizes; W-1 = 3 rows are not).
#
# The conv runs as a sliding window carried through the token loop: `prev` holds the W-1 inputs
# before token t, token t appends u_t, convolves, drops the oldest row. After a valid token t the
# window's last W-1 rows are the conv state after t+1 tokens, so `kept` takes them with the same
# select as the state tile (t < n_valid): after the loop it is the conv state after n_valid tokens
# (the old conv state when n_valid = 0), and padding rows (NaN or not) are never selected.
# ----------------------------------------------------------------------------------------------


def _conv_kernel(mixed_ref, conv_ref, w_ref, a_ref, b_ref, alog_ref, dtb_ref, n_ref, s_ref, halves_ref,
                 o_ref, s_out_ref, conv_out_ref, *, n_tokens: int, key_heads: int, r: int, dv: int, scale: float,
                 hoisted: bool = False, paired: bool = False):
    # mixed_ref [T, C]; conv_ref, conv_out_ref [W-1, C]; w_ref [C, W]; a_ref, b_ref [T]; alog_ref,
    # dtb_ref, n_ref scalars; s_ref, s_out_ref [Dk, BV], or [2, Dk, BV] when paired (read half
    # halves_ref[0], write half halves_ref[1]; the other half is left as it is); o_ref [T, BV]
    dk, bv = s_ref.shape[-2:]
    width = w_ref.shape[1]
    ih, iv = pl.program_id(1), pl.program_id(2)
    kh = ih // r
    groups = ((kh * dk, dk), ((key_heads + kh) * dk, dk), (2 * key_heads * dk + ih * dv + iv * bv, bv))  # q, k, v
    taps = tuple(tuple(w_ref[pl.ds(off, n), i].astype(F32) for i in range(width)) for off, n in groups)
    rnd = lambda x: x.astype(mixed_ref.dtype).astype(F32)  # the conv state joins the window in mixed's dtype
    prev0 = tuple(tuple(rnd(conv_ref[i, pl.ds(off, n)]) for i in range(width - 1)) for off, n in groups)
    decay = -jnp.exp(alog_ref[()].astype(F32))
    dt_bias = dtb_ref[()].astype(F32)
    n_valid = n_ref[()]

    def load(t):
        """Token t's raw rows (one [n] per group) and gate logits."""
        return tuple(mixed_ref[t, pl.ds(off, n)].astype(F32) for off, n in groups), a_ref[t], b_ref[t]

    def inputs(t, raw, prev, kept):
        """Token t's conv, norms and gates (no state): ((q_t, k_t, v_t, g_t, beta_t, valid), prev, kept)."""
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
        # q_t, k_t [Dk], v_t [BV]
        return (_l2(ys[0]) * scale, _l2(ys[1]), ys[2], decay * softplus, beta, valid), tuple(shifted), kept

    def token(t, carry):
        s, prev, kept = carry  # prev, kept: per group, W-1 rows [n] f32
        (q_t, k_t, v_t, g_t, beta, valid), prev, kept = inputs(t, load(t), prev, kept)
        s = jnp.where(valid, gdn._delta_update(s, k_t, v_t, g_t, beta), s)  # padding: old bits
        o_ref[t, :] = jnp.sum(s * q_t[:, None], axis=0).astype(o_ref.dtype)
        return s, prev, kept

    s = (s_ref[halves_ref[0]] if paired else s_ref[...]).astype(F32)
    if hoisted and n_tokens <= gdn.MAX_UNROLLED_TOKENS:
        # Every token's loads first, then every token's conv, norms and gates, then the state chain with
        # one reduction step per token: S^T k_t and S^T q_t both read S_{t-1} (independent, side by side),
        # and o_t = S_t^T q_t = exp(g_t) S_{t-1}^T q_t + (k_t . q_t) beta_t u_t with u_t = v_t - exp(g_t) S_{t-1}^T k_t
        raws = [load(t) for t in range(n_tokens)]
        prev = kept = prev0
        per_token = []
        for t in range(n_tokens):
            x, prev, kept = inputs(t, raws[t], prev, kept)
            per_token.append(x)
        kq = [jnp.sum(q_t * k_t) for q_t, k_t, *_ in per_token]  # k_t . q_t, scalars
        for t, (q_t, k_t, v_t, g_t, beta, valid) in enumerate(per_token):
            gamma = jnp.exp(g_t)
            sk = jnp.sum(s * k_t[:, None], axis=0)  # [BV]
            sq = jnp.sum(s * q_t[:, None], axis=0)
            bu = beta * (v_t - gamma * sk)
            o_ref[t, :] = (gamma * sq + kq[t] * bu).astype(o_ref.dtype)
            s = jnp.where(valid, s * gamma + k_t[:, None] * bu[None, :], s)  # padding: old bits
    else:
        carry = (s, prev0, prev0)
        if n_tokens <= gdn.MAX_UNROLLED_TOKENS:
            for t in range(n_tokens):
                carry = token(t, carry)
        else:
            carry = jax.lax.fori_loop(0, n_tokens, token, carry)
        s, _, kept = carry
    if paired:
        s_out_ref[halves_ref[1]] = s.astype(s_out_ref.dtype)
    else:
        s_out_ref[...] = s.astype(s_out_ref.dtype)

    def store(group):
        off, n = groups[group]
        for i in range(width - 1):
            conv_out_ref[i, pl.ds(off, n)] = kept[group][i].astype(conv_out_ref.dtype)

    store(2)  # the v slice belongs to this program alone
    # The q and k channels of key head h // r are convolved by all r * Dv / BV programs of that key
    # head, with identical results; exactly one of them (h % r == 0, j == 0) writes them, so no two
    # programs store to one address (no reliance on racing stores of equal bytes) and the other
    # programs skip the stores. The conv-state output must therefore not alias conv_state: a
    # program of the key head that starts later still reads the old rows.
    @pl.when((ih % r == 0) & (iv == 0))
    def _():
        store(0)
        store(1)


FORMS = ("sequential", "hoisted")


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"gdn_conv_recurrence: form {form!r} is not one of {FORMS}")


def gdn_conv_recurrence(mixed, conv_state, conv_w, a, b, a_log, dt_bias, state, n_valid, *, key_heads: int,
                        scale: float, interpret: bool = False, config: gdn.RecurrenceConfig | None = None,
                        in_place: bool = True, ba=None, halves=None):
    """Pallas twin of `gdn_conv_recurrence_ref` -> (o [B, T, Hv, Dv] f32, state [B, Hv, Dk, Dv] f32,
    conv state [B, W-1, C]). Dk must be a power of two; the Dv tile BV as in `gdn.gdn_recurrence`.
    With in_place, the state output aliases the (f32) state input (in place when donated; when the
    caller still needs the input, XLA copies it first); otherwise the state is written to a new
    buffer. The conv state is a new buffer (see the kernel). T <= gdn.MAX_UNROLLED_TOKENS is
    unrolled, longer T loops. With ba (instead of a and b), the kernel reads b and a from its two
    halves: ba goes in twice, with block index maps h and Hv + h. With halves = (read, write) int [2],
    state is a double-buffered pair [2, B, Hv, Dk, Dv] (f32), always in place: each program reads its
    tile of half `read` and writes it to half `write`, so a caller that needs the old state afterwards
    (the speculative commit) finds it in half `read` of the returned pair, and nothing is copied."""
    config = config or gdn.RECURRENCE_CONFIG
    if halves is not None:
        _check_halves(state, halves)
        if state.dtype != F32 or not in_place:
            raise ValueError(f"gdn_conv_recurrence: a double-buffered state must be f32 ({state.dtype}) and in place")
        pair, state = state, state[0]  # the single-state checks below run on one half's shape
    # the shapes are checked on ba's halves (slices nothing uses: traced, then dropped from the program)
    _check(mixed, conv_state, conv_w, *_gates(a, b, ba, state.shape[1] if state.ndim == 4 else 0), a_log, dt_bias,
           state, n_valid, key_heads)
    bsz, t, c = mixed.shape
    hv, dk, dv = state.shape[1:]
    width = conv_w.shape[1]
    if not gdn._is_pow2(dk):
        raise ValueError(f"gdn_conv_recurrence: Dk = {dk} must be a power of two (Triton tensor sizes)")
    if not gdn._is_pow2(config.block_v) or config.num_warps < 1 or config.num_stages < 1:
        raise ValueError(f"gdn_conv_recurrence: bad config {config}: block_v must be a power of two, "
                         "num_warps and num_stages >= 1")
    bv = gdn._block_v(dv, config)
    state = state.astype(F32) if halves is None else pair
    if t == 0:
        return jnp.zeros((bsz, 0, hv, dv), F32), (state if halves is None else write_half(
            pair, halves, read_half(pair, halves))), conv_state
    sq = pl.squeezed
    row_spec = lambda rows: pl.BlockSpec((sq, rows, c), lambda ib, ih, iv: (ib, 0, 0))  # [rows, C] of sequence b
    tv_spec = pl.BlockSpec((sq, t, sq, bv), lambda ib, ih, iv: (ib, 0, ih, iv))
    a_offset = 0 if ba is None else hv  # the block index of a's head h: h, or Hv + h inside ba = [b | a]
    a_spec = pl.BlockSpec((sq, t, sq), lambda ib, ih, iv: (ib, 0, a_offset + ih))
    b_spec = pl.BlockSpec((sq, t, sq), lambda ib, ih, iv: (ib, 0, ih))
    head_spec = pl.BlockSpec((sq,), lambda ib, ih, iv: (ih,))
    batch_spec = pl.BlockSpec((sq,), lambda ib, ih, iv: (ib,))
    if halves is None:
        s_spec = pl.BlockSpec((sq, sq, dk, bv), lambda ib, ih, iv: (ib, ih, 0, iv))
        halves = jnp.zeros((2,), jnp.int32)  # unread
    else:
        s_spec = pl.BlockSpec((2, sq, sq, dk, bv), lambda ib, ih, iv: (0, ib, ih, 0, iv))
    halves_spec = pl.BlockSpec((2,), lambda ib, ih, iv: (0,))
    w_spec = pl.BlockSpec((c, width), lambda ib, ih, iv: (0, 0))
    _check_form(config.form)
    kernel = functools.partial(_conv_kernel, n_tokens=t, key_heads=key_heads, r=hv // key_heads, dv=dv,
                               scale=float(scale), hoisted=config.form == "hoisted", paired=state.ndim == 5)
    if ba is not None:
        a = b = ba
    args, out = align(mixed, conv_state, conv_w, a, b, a_log, dt_bias, n_valid.astype(jnp.int32), state,
                      halves.astype(jnp.int32))
    return pl.pallas_call(
        kernel,
        out_shape=(out((bsz, t, hv, dv), F32), out(state.shape, F32), out(conv_state.shape, conv_state.dtype)),
        grid=(bsz, hv, dv // bv),
        in_specs=[row_spec(t), row_spec(width - 1), w_spec, a_spec, b_spec, head_spec, head_spec,
                  batch_spec, s_spec, halves_spec],
        out_specs=[tv_spec, s_spec, row_spec(width - 1)],
        input_output_aliases={8: 1} if in_place else {},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="gdn_conv_recurrence",
    )(*args)
