"""Where a speculative round's time goes: each piece timed alone, on the device, in one jitted loop.

A round of MTP K is (K-1) draft steps + one verify pass over K+1 tokens + the GDN/conv commit +
one draft refresh (speculate.spec_loop). Each piece runs `n` times inside a jitted fori_loop over
the loaded model and a real decode state (positions reset every iteration, so the cache never
grows); its time is (t(n_long) - t(n_short)) / (n_long - n_short) with one compiled program, so
dispatch and set-up cancel. The fresh state of each call is built and on the device before its
clock starts: at TP2 building it took long and varied enough to swamp the difference (a draft
step of -1.4 ms in the first TP2 run).

    target_step  model.forward over 1 token + logits + argmax       (a plain decode step)
    verify       model.forward over K+1 tokens (into the GDN state slots, or with the GDN replay)
                 + logits + argmax
    draft        mtp.forward over 1 token + draft logits + argmax  (one draft step; through the FP8
                 draft head when the model has one, as the spec loop's drafts are)
    commit       with ops.GDN_STATE_SLOTS the read slots' move (no kernel); otherwise
                 model.commit_gdn: the GDN/conv state after the accepted prefix (a round that kept
                 every verified token skips it: speculate.SKIP_FULL_COMMIT)
    all_reduce   (TP > 1) the collectives of one target pass alone: 2 per layer + 1 (embedding)
                 all-reduces of [B, E] f32 and the argmax's all-gather of [B, 2] f32

predicted round = (K-1) draft + verify + commit + draft; the harness compares it with the measured
round (decode time / rounds): the difference is the loop's own bookkeeping, less the commits that
full-acceptance rounds skip.

On a GPU each piece also gets `device_<piece>`: the device's busy time per iteration (the union of
its kernels in a profiler trace of one N_LONG call, the busiest device under TP; no idle gaps),
and `device_predicted_round` from those; measure() also hands back each piece's launches by kind
(bench_report.kernel_diff_table: what the verify pass adds to a target step, launch kind by kind). A piece of few small launches (the commit: 48 GDN kernels)
can be bound by the host's loop rather than the device, so its wall-clock figure overstates what
it costs inside a round, where the device stays busy (session 8: 1.05 ms by the wall clock).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from pallas_kernels import gdn_conv
from qmtp import decode, model as model_lib, mtp, speculate, tp
from qmtp.config import ModelConfig

N_SHORT, N_LONG, REPEATS = 2, 18, 3


def _reset(state, lengths):
    return dataclasses.replace(state, lengths=lengths)


@functools.partial(jax.jit, static_argnames=("cfg", "t", "impl"))
def target_loop(cfg: ModelConfig, params, state, n, t: int, impl: str):
    b = state.lengths.shape[0]
    lengths = state.lengths

    # the verify pass as the spec loop runs it: with ops.GDN_STATE_SLOTS on slotted GDN/conv state, each
    # pass reading the slot the last one wrote after its first token (the state moves on as in a round);
    # a target step as the plain loop runs it (two slots with ops.GDN_PLAIN_SLOTS)
    if t > 1:
        state, slots = speculate.slotted_state(state, t - 1, impl)
    elif state.ssm and decode.plain_gdn_slots(impl, state.ssm[0].dtype):
        state, slots = decode.slot_gdn_state(state, decode.PLAIN_GDN_SLOTS)
    else:
        slots = None

    def body(_, carry):
        state, tok, slots = carry
        tokens = jnp.broadcast_to(tok[:, None], (b, t))
        if t == 1 and slots is None:
            hidden, state = model_lib.forward(cfg, params, _reset(state, lengths), tokens, jnp.full((b,), t), impl=impl)
        elif slots is None:
            hidden, state, _ = model_lib.forward(cfg, params, _reset(state, lengths), tokens, jnp.full((b,), t),
                                                 impl=impl, return_gdn_replay=True)
        else:
            hidden, state = model_lib.forward(cfg, params, _reset(state, lengths), tokens, jnp.full((b,), t),
                                              impl=impl, gdn_slots=slots)
            slots = gdn_conv.next_slots(slots, jnp.ones_like(slots), state.ssm[0].shape[0])
        nxt = decode.greedy(model_lib.logits_from_hidden(params, hidden, impl))  # [B, T]
        return state, nxt[:, -1], slots

    state, tok, slots = jax.lax.fori_loop(0, n, body, (state, jnp.zeros((b,), jnp.int32), slots))
    return tok, speculate.unslotted_state(state, slots)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def draft_loop(cfg: ModelConfig, params, state, n, impl: str):
    b = state.lengths.shape[0]
    e = cfg.hidden_size

    def body(_, carry):
        state, tok, h = carry
        hs, state = mtp.forward(cfg, params, state, tok[:, None], h[:, None], state.lengths, jnp.ones((b,), jnp.int32),
                                impl=impl)
        return state, model_lib.draft_token(params, hs[:, 0], impl), hs[:, 0]

    carry = (state, jnp.zeros((b,), jnp.int32), jnp.zeros((b, e), state.kv.k[0].dtype))
    state, tok, _ = jax.lax.fori_loop(0, n, body, carry)
    return tok, state


@functools.partial(jax.jit, static_argnames=("cfg", "k", "impl"))
def commit_loop(cfg: ModelConfig, params, state, n, k: int, impl: str):
    b = state.lengths.shape[0]
    state, slots = speculate.slotted_state(state, k, impl)
    if slots is not None:  # ops.GDN_STATE_SLOTS: the commit is the read slots' move, as in speculate._round
        n_slots = state.ssm[0].shape[0]
        slots = jax.lax.fori_loop(0, n, lambda i, s: gdn_conv.next_slots(s, jnp.full((b,), 1 + i % k), n_slots), slots)
        return state.lengths, speculate.unslotted_state(state, slots)
    tokens = jnp.zeros((b, k + 1), jnp.int32)
    _, state, replay = model_lib.forward(cfg, params, state, tokens, jnp.full((b,), k + 1), impl=impl,
                                         return_gdn_replay=True)

    def body(i, ssm):
        _, ssm = model_lib.commit_gdn(replay, ssm, jnp.full((b,), 1 + i % k, jnp.int32), impl=impl)
        return ssm

    state = dataclasses.replace(state, ssm=jax.lax.fori_loop(0, n, body, state.ssm))
    return state.lengths, state  # the work lives on in the returned state


@functools.partial(jax.jit, static_argnames=("cfg",))
def all_reduce_loop(cfg: ModelConfig, params, state, n):
    b = state.lengths.shape[0]
    count = 2 * cfg.num_hidden_layers + 1
    # a factor that differs per shard (a vocabulary-split embedding entry), so each reduction is a
    # real cross-device sum, as the model's partial sums are
    f = 1.0 + 1e-9 * params["embed"][0, 0].astype(jnp.float32)

    def body(_, x):
        for _ in range(count):
            x = tp.all_reduce(x * f) * 0.5
        pair = jax.lax.all_gather(x[:, :2], tp.AXIS, axis=0, to="invarying")  # the argmax's (max, id) pairs
        return x + 1e-30 * jnp.min(pair, axis=0).sum()

    x = jax.lax.fori_loop(0, n, body, jnp.ones((b, cfg.hidden_size), jnp.float32))
    return x[:, 0].astype(jnp.int32), state


def _time_piece(call, make_input, n_short=N_SHORT, n_long=N_LONG, repeats=REPEATS) -> float:
    """Seconds per iteration of a loop `call(input, n) -> result`, from two trip counts (compiled
    once); `make_input()` builds each call's (donated) input outside the timed region."""
    jax.block_until_ready(call(make_input(), n_short))  # compile + warm up
    times = {}
    for n in (n_short, n_long) * repeats:
        x = jax.block_until_ready(make_input())
        t = time.perf_counter()
        jax.block_until_ready(call(x, n))
        times.setdefault(n, []).append(time.perf_counter() - t)
    return (min(times[n_long]) - min(times[n_short])) / (n_long - n_short)


def measure(model, new_state, k: int, kernels: dict | None = None, only: tuple | None = None) -> dict:
    """Seconds per piece for MTP K on `model`; new_state() gives a fresh decode state (donated).
    On a GPU, `kernels` (when given) receives each piece's launches per iteration by kind
    ({piece: {launch kind: {"us", "count"}}}, see _device_piece). `only`: the pieces to time (all by
    default; the predicted round needs draft, verify and commit)."""
    from qmtp.api import _call
    kernels = {} if kernels is None else kernels
    pieces = {"target_step": (target_loop, {"t": 1}), "verify": (target_loop, {"t": k + 1}),
              "draft": (draft_loop, {}), "commit": (commit_loop, {"k": k})}
    if model.tp > 1:
        pieces["all_reduce"] = (all_reduce_loop, {})
    if only is not None:
        unknown = sorted(set(only) - set(pieces))
        if unknown:
            raise ValueError(f"unknown breakdown piece(s) {', '.join(unknown)}; known: {', '.join(pieces)}")
        pieces = {n: v for n, v in pieces.items() if n in only}
    out = {}
    for name, (fn, extra) in pieces.items():
        static = dict(extra, impl=model.impl) if fn is not all_reduce_loop else {}

        def call(state, n, fn=fn, static=static):
            args = (model.params, state, jnp.int32(n))
            return _call(model, fn, (model.cfg,), args, ("params", "state", "rep"), ("rep", "state"), **static)

        out[name] = _time_piece(call, new_state)
        device = _device_piece(call, new_state)
        if device is not None:
            out[f"device_{name}"], kernels[name] = device
    if {"draft", "verify", "commit"} <= set(out):
        out["predicted_round"] = _predicted_round(out, k, "")
    if {"device_draft", "device_verify", "device_commit"} <= set(out):
        out["device_predicted_round"] = _predicted_round(out, k, "device_")
    return out


def _predicted_round(pieces: dict, k: int, key: str) -> float:
    return (k - 1) * pieces[f"{key}draft"] + pieces[f"{key}verify"] + pieces[f"{key}commit"] + pieces[f"{key}draft"]


def _device_piece(call, make_input, n=N_LONG) -> tuple[float, dict] | None:
    """(device busy seconds per iteration of `call(input, n)` (compiled already), its launches per
    iteration by kind {kind: {"us", "count"}}) from one profiled call (pallas_kernels.bench.trace_events:
    the busiest device; kinds are launch names without their numbering, so two pieces' programs
    compare kind by kind); None without GPU events (a CPU run)."""
    from pallas_kernels.bench import trace_events
    got = trace_events.device_time(call, jax.block_until_ready(make_input()), n, prefix="")
    if got is None:
        return None
    kinds = {kind: {"us": row["us"] / n, "count": row["count"] / n} for kind, row in (got.get("kernels") or {}).items()}
    return got["busy_s_per_device"] / n, kinds
