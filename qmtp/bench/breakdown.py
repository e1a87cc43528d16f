"""Where a speculative round's time goes: each piece timed alone, on the device, in one jitted loop.

A round of MTP K is (K-1) draft steps + one verify pass over K+1 tokens + one draft refresh
(qmtp/runtime/loop.py; the commit is an index move of the GDN slot ring). Each piece runs `n` times inside a
jitted fori_loop over the loaded model and a real decode state (positions reset every iteration, so
the cache never grows); its time is (t(n_long) - t(n_short)) / (n_long - n_short) with one compiled
program, so dispatch and set-up cancel. The fresh state of each call is built and on the device
before its clock starts (at TP2 building it took long and varied enough to swamp the difference).

    target_step  model.forward over 1 token into the ring + logits + argmax   (a plain decode step)
    verify       model.forward over K+1 tokens into the ring + logits + argmax
    draft        mtp.forward over 1 token + draft logits + argmax  (one draft step; through the FP8
                 draft head when the model has one, as the loop's drafts are)
    all_reduce   (TP > 1) the collectives of one target pass alone: 2 per layer + 1 (embedding)
                 all-reduces of [B, E] f32 and the argmax's all-gather of [B, 2] f32

predicted round = K draft + verify; the harness compares it with the measured round (decode time /
rounds): the difference is the loop's own bookkeeping.

On a GPU each piece also gets `device_<piece>`: the device's busy time per iteration (the union of
its kernels in a profiler trace of one N_LONG call, the busiest device under TP; no idle gaps),
and `device_predicted_round` from those; measure() also hands back each piece's launches by kind
(bench_report.kernel_diff_table: what the verify pass adds to a target step, launch kind by kind).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from qmtp.model import mtp, target as model_lib
from qmtp.model.config import ModelConfig
from qmtp.runtime import loop, ops, tp
from qmtp.runtime.kernel_config import KernelConfig

N_SHORT, N_LONG, REPEATS = 2, 18, 3


def _reset(state, lengths):
    return dataclasses.replace(state, lengths=lengths)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "t"))
def target_loop(cfg: ModelConfig, kernels: KernelConfig, t: int, params, state, n):
    """n target passes over t tokens each, as the loop runs them: into the GDN slot ring of K+2 = t+1
    slots, each pass reading the slot the last one wrote after its first token."""
    b = state.lengths.shape[0]
    lengths = state.lengths
    state = loop.to_ring(state, loop.ring_size(t - 1))

    def body(_, carry):
        state, tok, read = carry
        tokens = jnp.broadcast_to(tok[:, None], (b, t))
        hidden, state = model_lib.forward(cfg, params, _reset(state, lengths), tokens, jnp.full((b,), t), kernels,
                                          gdn_slots=read)
        read = ops.next_slots(read, jnp.ones_like(read), loop.ring_size(t - 1))
        nxt = loop.greedy(model_lib.logits_from_hidden(params, hidden, kernels))  # [B, T]
        return state, nxt[:, -1], read

    zeros = jnp.zeros((b,), jnp.int32)
    state, tok, read = jax.lax.fori_loop(0, n, body, (state, zeros, zeros))
    return tok, loop.from_ring(state, read)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels"))
def draft_loop(cfg: ModelConfig, kernels: KernelConfig, params, state, n):
    b = state.lengths.shape[0]
    e = cfg.hidden_size

    def body(_, carry):
        state, tok, h = carry
        hs, state = mtp.forward(cfg, params, state, tok[:, None], h[:, None], state.lengths, jnp.ones((b,), jnp.int32),
                                kernels)
        return state, model_lib.draft_token(params, hs[:, 0], kernels), hs[:, 0]

    carry = (state, jnp.zeros((b,), jnp.int32), jnp.zeros((b, e), state.kv.k[0].dtype))
    state, tok, _ = jax.lax.fori_loop(0, n, body, carry)
    return tok, state


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
    default; the predicted round needs draft and verify)."""
    from qmtp.api import _call
    kernels = {} if kernels is None else kernels
    pieces = {"target_step": (target_loop, (1,)), "verify": (target_loop, (k + 1,)), "draft": (draft_loop, ())}
    if model.tp > 1:
        pieces["all_reduce"] = (all_reduce_loop, ())
    if only is not None:
        unknown = sorted(set(only) - set(pieces))
        if unknown:
            raise ValueError(f"unknown breakdown piece(s) {', '.join(unknown)}; known: {', '.join(pieces)}")
        pieces = {n: v for n, v in pieces.items() if n in only}
    out = {}
    for name, (fn, extra) in pieces.items():
        lead = (model.cfg,) if fn is all_reduce_loop else (model.cfg, model.kernels) + extra

        def call(state, n, fn=fn, lead=lead):
            args = (model.params, state, jnp.int32(n))
            return _call(model, fn, lead, args, ("params", "state", "rep"), ("rep", "state"))

        out[name] = _time_piece(call, new_state)
        device = _device_piece(call, new_state)
        if device is not None:
            out[f"device_{name}"], kernels[name] = device
    if {"draft", "verify"} <= set(out):
        out["predicted_round"] = _predicted_round(out, k, "")
    if {"device_draft", "device_verify"} <= set(out):
        out["device_predicted_round"] = _predicted_round(out, k, "device_")
    return out


def _predicted_round(pieces: dict, k: int, key: str) -> float:
    return k * pieces[f"{key}draft"] + pieces[f"{key}verify"]


def _device_piece(call, make_input, n=N_LONG) -> tuple[float, dict] | None:
    """(device busy seconds per iteration of `call(input, n)` (compiled already), its launches per
    iteration by kind {kind: {"us", "count"}}) from one profiled call (ops.device_time:
    the busiest device; kinds are launch names without their numbering, so two pieces' programs
    compare kind by kind); None without GPU events (a CPU run)."""
    got = ops.device_time(call, jax.block_until_ready(make_input()), n, prefix="")
    if got is None:
        return None
    kinds = {kind: {"us": row["us"] / n, "count": row["count"] / n} for kind, row in (got.get("kernels") or {}).items()}
    return got["busy_s_per_device"] / n, kinds
