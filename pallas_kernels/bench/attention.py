"""Paged attention at the Qwen3.5-27B shapes (Hq 24, Hkv 4, D 256, bf16 KV, 16-slot pages): the Pallas
kernel (impl "pallas", default config) vs the jnp reference `paged_attention_ref` (impl "xla").

Cases (kernel "paged_attention"): B in {1, 8}, T in {1, 4 = K+1 verify for K = 3, 5}, every sequence
at the full context in {1K, 4K, 8K, 32K}. Each case builds `layers` separate KV caches (shuffled
pages), enough that the caches of one pass hold >= 8x the 50 MiB L2; one jitted program runs `reps`
rounds over all layers (each round's queries depend on the previous round's output, so nothing is
hoisted or overlapped across rounds). s_per_call = median wall time / (reps * layers).
bytes = 2 (K and V) * B * context * Hkv * D * itemsize: the KV bytes attention must read, charged
identically to both implementations. rel_err (pallas row) = max |o - o_ref| / max |o_ref| on one layer
(both outputs are bf16: one bf16 ulp, up to 2^-8 = 4e-3, is the expected figure).
speedup_vs_xla = xla s_per_call / pallas s_per_call.

Prefill (kernel "paged_attention_prefill", `run_prefill`): B = 1, the last T tokens (2048: a prefill chunk;
128: a serving piece) of a prompt of 8K or 32K tokens (its queries attend to every earlier key and
causally to their own), one row per tile config "ROWSxWARPSxBKxSTAGES" (query rows per program, warps,
keys per step, pipeline stages; the first the default). tflop_s counts the causal products, 4 Hq D per
(query, key) pair; rel_err against `paged_attention_ref` (which holds the [T, context] scores).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paged_attention as pa
from pallas_kernels.bench.common import timed

HQ, HKV, D = 24, 4, 256
PAGE_SIZE = 16
DTYPE = jnp.bfloat16
L2_BYTES = 50 * 2 ** 20  # H200 L2 (50 MiB); the caches of one round are made >= 8x this


@dataclasses.dataclass(frozen=True)
class Sizes:
    batches: tuple = (1, 8)
    tokens: tuple = (1, 4, 5)  # decode, K+1 verify for K = 3, the default K = 4
    contexts: tuple = (1024, 4096, 8192, 32768)
    max_layers: int = 64
    reps: int = 10  # rounds over all layers per timed call
    repeats: int = 5  # timed calls per case (median reported)


def sizes(quick: bool, interpret: bool) -> Sizes:
    """The full sweep; quick: B = 1, T in {1, 5}, 8K context; interpret (CPU smoke test of the code
    paths): a short context, two layers, one round."""
    s = Sizes()
    if quick:
        s = dataclasses.replace(s, batches=(1,), tokens=(1, 5), contexts=(8192,), repeats=3)
    if interpret:
        s = dataclasses.replace(s, contexts=tuple(sorted({min(c, 512) for c in s.contexts})), max_layers=2,
                                reps=1, repeats=2)
    return s


def make_case(rng, b: int, t: int, context: int, layers: int):
    """q [B, T, Hq, D], `layers` K and V page pools [P, S, Hkv, D], shuffled page tables, the T queries
    at the last T positions of a full `context`."""
    pmax = -(-context // PAGE_SIZE)
    n_pages = b * pmax
    tables = rng.permutation(n_pages).reshape(b, pmax).astype(np.int32)
    kv_lengths = np.full((b,), context, np.int32)
    q_positions = (context - t + np.arange(t, dtype=np.int32))[None].repeat(b, 0)
    q = jnp.asarray(rng.standard_normal((b, t, HQ, D)), DTYPE)
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    shape = (n_pages, PAGE_SIZE, HKV, D)
    ks, vs = [], []
    for i in range(layers):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        ks.append(jax.random.normal(k1, shape, DTYPE))
        vs.append(jax.random.normal(k2, shape, DTYPE))
    return q, ks, vs, jnp.asarray(tables), jnp.asarray(q_positions), jnp.asarray(kv_lengths)


def make_program(attn, layers: int, reps: int):
    def program(q, ks, vs, page_table, q_positions, kv_lengths):
        def round_(_, carry):
            qq = q + (carry * 1e-30).astype(q.dtype)  # a true dependency on the previous round
            total = jnp.zeros((), jnp.float32)
            for i in range(layers):
                o = attn(qq, ks[i], vs[i], page_table, q_positions, kv_lengths)
                total = total + jnp.sum(jnp.square(o.astype(jnp.float32)))  # all of o, nonlinearly
            return total

        return jax.lax.fori_loop(0, reps, round_, jnp.zeros((), jnp.float32))

    return jax.jit(program)


def _row(base: dict, nbytes: int, s_per_call: float, copy_tb_s: float) -> dict:
    tb_s = nbytes / s_per_call / 1e12
    return {**base, "s_per_call": s_per_call, "bytes": int(nbytes), "tb_s": tb_s, "share_of_copy": tb_s / copy_tb_s}


def _error_row(base: dict, nbytes: int, e: Exception) -> dict:
    # one failing case must not hide the others: record it and go on
    print(f"{base['kernel']} {base['case']} {base['impl']} failed: {e!r}", file=sys.stderr, flush=True)
    return {**base, "s_per_call": None, "bytes": int(nbytes), "tb_s": None, "share_of_copy": None,
            "error": repr(e)[:1000]}


def run(copy_tb_s: float, emit, *, quick: bool = False, interpret: bool = False) -> None:
    """Times the kernel and its XLA/jnp reference at the Qwen3.5-27B shapes; calls emit(row) per measured case."""
    sz = sizes(quick, interpret)
    config = pa.DEFAULT_CONFIG
    scale = D ** -0.5
    impls = {"pallas": lambda *a: pa.paged_attention(*a, scale, config=config, interpret=interpret),
             "xla": lambda *a: pa.paged_attention_ref(*a, scale)}
    itemsize = jnp.dtype(DTYPE).itemsize
    rng = np.random.default_rng(0)
    for b in sz.batches:
        for t in sz.tokens:
            for context in sz.contexts:
                nbytes = 2 * b * context * HKV * D * itemsize  # per layer call
                layers = max(2, min(sz.max_layers, math.ceil(8 * L2_BYTES / nbytes)))
                base = {"kernel": "paged_attention", "case": f"B={b} T={t} ctx={context}", "B": b, "T": t,
                        "ctx": context, "dtype": jnp.dtype(DTYPE).name, "layers": layers, "reps": sz.reps,
                        "n_splits": config.num_splits(b, HKV, -(-context // PAGE_SIZE) * PAGE_SIZE)}
                rows = {}
                try:
                    inputs = make_case(rng, b, t, context, layers)
                except Exception as e:  # both rows carry the failure
                    for impl in impls:
                        emit(_error_row({**base, "impl": impl}, nbytes, e))
                    continue
                q, ks, vs, pt, qp, kl = inputs
                one = (q, ks[0], vs[0], pt, qp, kl)
                for impl, attn in impls.items():
                    row_base = {"kernel": base["kernel"], "case": base["case"], "impl": impl, **base}
                    try:
                        extra = {}
                        if impl == "pallas":
                            got = np.asarray(jax.jit(attn)(*one), np.float64)
                            want = np.asarray(jax.jit(impls["xla"])(*one), np.float64)
                            extra["rel_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                        med, best = timed(make_program(attn, layers, sz.reps), *inputs, trials=sz.repeats)
                        calls = sz.reps * layers
                        rows[impl] = {**_row(row_base, nbytes, med / calls, copy_tb_s), **extra,
                                      "best_s_per_call": best / calls}
                    except Exception as e:
                        rows[impl] = _error_row(row_base, nbytes, e)
                if rows["pallas"]["s_per_call"] and rows["xla"]["s_per_call"]:
                    rows["pallas"]["speedup_vs_xla"] = rows["xla"]["s_per_call"] / rows["pallas"]["s_per_call"]
                for row in rows.values():
                    emit(row)
                del inputs, q, ks, vs, one


PREFILL_TOKENS = 2048  # the default prefill chunk
PREFILL_CONTEXTS = (8192, 32768)
PREFILL_CONFIGS = ("128x8x64x2", "32x4x64x2", "64x4x32x3", "128x8x32x2", "128x8x64x3", "256x8x32x2")


def parse_prefill_config(text: str) -> pa.PagedAttentionConfig:
    """"ROWSxWARPSxBKxSTAGES" -> the config a prefill of this tile runs (ValueError naming the text)."""
    try:
        rows, warps, block_k, stages = (int(v) for v in text.split("x"))
    except ValueError:
        raise ValueError(f"attention prefill config {text!r}: expected ROWSxWARPSxBKxSTAGES, e.g. 64x4x64x2") from None
    return pa.PagedAttentionConfig(prefill_rows=rows, prefill_num_warps=warps, block_k=block_k, num_stages=stages,
                                   max_tile_bytes=max(pa.DEFAULT_CONFIG.max_tile_bytes, 2 * block_k * D * 2))


def prefill_flops(t: int, context: int) -> float:
    """4 Hq D per (query, key) pair: queries at positions context - t .. context - 1, each with its keys
    up to itself."""
    pairs = t * (context - t) + t * (t + 1) // 2
    return 4.0 * HQ * D * pairs


def _prefill_tile(config: pa.PagedAttentionConfig) -> tuple:
    """What a prefill config string sets: query rows, warps, keys per step, stages."""
    return config.prefill_rows, config.prefill_num_warps, config.block_k, config.num_stages


def run_prefill(copy_tb_s: float, emit, *, quick: bool = False, interpret: bool = False,
                configs=PREFILL_CONFIGS, tokens=(PREFILL_TOKENS,)) -> None:
    """Times the prefill tile configs (see the module docstring); calls emit(row) per config, context and
    number of new tokens."""
    parsed = [(c, parse_prefill_config(c)) for c in configs]  # a typo fails before anything runs
    contexts, reps, trials = PREFILL_CONTEXTS, 3, 3
    if quick:
        contexts = contexts[:1]
    if interpret:
        tokens, contexts, reps, trials, parsed = (32,), (64,), 1, 1, parsed[:2]
    for t in tokens:
        _prefill_rows(copy_tb_s, emit, parsed, t, contexts, reps, trials, interpret)


def _prefill_rows(copy_tb_s, emit, parsed, t, contexts, reps, trials, interpret) -> None:
    """One row per (config, context) for the last t tokens of each context."""
    scale = D ** -0.5
    rng = np.random.default_rng(1)
    for context in contexts:
        nbytes = 2 * context * HKV * D * jnp.dtype(DTYPE).itemsize
        q, ks, vs, pt, qp, kl = make_case(rng, 1, t, context, 2)
        want = np.asarray(jax.jit(lambda *a: pa.paged_attention_ref(*a, scale))(q, ks[0], vs[0], pt, qp, kl),
                          np.float64)
        for name, config in parsed:
            base = {"kernel": "paged_attention_prefill", "case": f"T={t} ctx={context}", "impl": "pallas",
                    "config": name, "default": _prefill_tile(config) == _prefill_tile(pa.DEFAULT_CONFIG), "B": 1,
                    "T": t, "ctx": context, "layers": 2, "reps": reps}
            attn = lambda *a, config=config: pa.paged_attention(*a, scale, config=config, interpret=interpret)
            try:
                got = np.asarray(jax.jit(attn)(q, ks[0], vs[0], pt, qp, kl), np.float64)
                med, best = timed(make_program(attn, 2, reps), q, ks, vs, pt, qp, kl, trials=trials)
                s = med / (2 * reps)
                row = {**_row(base, nbytes, s, copy_tb_s), "best_s_per_call": best / (2 * reps),
                       "tflop_s": prefill_flops(t, context) / s / 1e12,
                       "rel_err": float(np.max(np.abs(got - want)) / np.max(np.abs(want)))}
            except Exception as e:
                row = _error_row(base, nbytes, e)
            emit(row)
        del q, ks, vs, want
