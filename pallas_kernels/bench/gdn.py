"""Gated DeltaNet at the Qwen3.5-27B shapes (Hk 16, Hv 48, Dk = Dv = 128): Pallas vs the jnp refs.

Decode / verify from the raw in_proj output (kernel "gdn_conv_decode", B in {1, 8, 16}, T in {1, 4 =
K+1 verify for K = 3, 5}): the Pallas `gdn_conv.gdn_conv_recurrence` (conv, norms, gates and the
recurrence in one kernel; impl "pallas", one row per tile config "BVxWARPS", the first the default)
against `gdn_conv_recurrence_ref` (impl "xla"), each timed inside one jitted fori_loop that updates
`layers` distinct states per iteration (48 = one decode step of the 27B model, 144 MiB of state per
sequence: far more than the 50 MB L2, and no host dispatch per call). s_per_call = median wall time /
(layers * iters). bytes = 2 * B * Hv * Dk * Dv * 4: the f32 state read and written once per call (the
raw inputs and o are ~1% of it). rel_err = max |x - x_ref| / max |x_ref| over o and the state.

Chunked prefill (kernel "gdn_prefill", B = 1, T in {512, 4096}): `gdn_chunked_ref` (impl "xla": the chain
over chunks a lax.scan) and `gdn_chunked.gdn_chunked` (impl "pallas": the chain in one kernel; the prefill
path under Pallas), `prefill_layers` layers in one jitted program. bytes = the state read +
written, q, k, v, g, beta read and o written (all f32). The argument the rows carry: is the chunked
form cheap enough for prefill? tokens_per_s (one layer), tokens_per_s_48_layers (all GDN layers), and
share_of_layer = t_gdn / (t_gdn + t_matmuls), where t_matmuls is the same run's time for the bf16 XLA
matmuls of one 27B GDN decoder layer (in_proj qkv, z, b/a, out_proj, MLP gate/up/down) over the same
T tokens. Impl "wy_inputs" times the form's chunk-parallel half alone (`gdn.wy_chunk_inputs`, in both
impls' rows).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gdn as gdn_kernel
from pallas_kernels import gdn_chunked
from pallas_kernels import gdn_conv

HK, HV, DK, DV = 16, 48, 128, 128
HIDDEN, FFN = 5120, 17408
GDN_LAYERS = 48
CHUNK = 64  # gdn_chunked_ref's default chunk
# The conv kernel's tile sweep, block_v x num_warps (the first: the default, gdn_conv.RECURRENCE_CONFIG).
# Narrower tiles give more programs (Hv * Dv / BV: 192 at BV = 32, ~1.5 per SM of the H200) for a
# per-token chain that is latency-bound; each program convolves its key head's q and k channels again.
# Fewer warps keep the per-token reductions (the L2 norms, S^T k, S^T q) inside a warp.
CONV_CONFIGS = ("32x4", "16x4", "8x4", "16x2", "8x2", "16x1", "8x1", "64x4")


@dataclasses.dataclass(frozen=True)
class Sizes:
    batches: tuple = (1, 8, 16)
    tokens: tuple = (1, 4, 5)  # decode, K+1 verify for K = 3, the default K = 4
    conv_configs: tuple = CONV_CONFIGS
    layers: int = GDN_LAYERS  # distinct states per loop iteration (one decode step's worth)
    iters: int = 20
    repeats: int = 7
    prefill_tokens: tuple = (512, 4096)
    prefill_layers: int = 4
    hidden: int = HIDDEN
    ffn: int = FFN


def sizes(quick: bool, interpret: bool) -> Sizes:
    """The full sweep; quick: one batch, T in {1, 5}, the default config, one prefill length;
    interpret (CPU smoke test of the code paths): few layers and calls, small layer matmuls."""
    s = Sizes()
    if quick:
        s = dataclasses.replace(s, batches=(1,), tokens=(1, 5), conv_configs=CONV_CONFIGS[:1],
                                repeats=3, prefill_tokens=(512,))
    if interpret:
        s = dataclasses.replace(s, layers=2, iters=1, repeats=2, prefill_layers=1, hidden=256, ffn=512,
                                prefill_tokens=tuple(min(t, CHUNK) for t in s.prefill_tokens[:1]))
    return s


def _timing(step, carry, consts, repeats: int):
    """carry = step(carry, consts) once to compile and warm, then `repeats` times timed. The carry is
    donated (updated in place) and the inputs are arguments, never closed-over constants (which XLA
    could fold or hoist). Returns the last carry and (median_s, best_s, first_call_s)."""
    t0 = time.perf_counter()
    carry = jax.block_until_ready(step(carry, consts))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(step(carry, consts))
        times.append(time.perf_counter() - t0)
    return carry, (statistics.median(times), min(times), first)


def _rates(nbytes: int, s_per_call: float, copy_tb_s: float) -> dict:
    tb_s = nbytes / s_per_call / 1e12
    return {"s_per_call": s_per_call, "bytes": int(nbytes), "tb_s": tb_s, "share_of_copy": tb_s / copy_tb_s}


def _error_row(base: dict, nbytes: int, e: Exception) -> dict:
    # one failing case must not hide the others: record it and go on
    print(f"{base['kernel']} {base['case']} {base['impl']} failed: {e!r}", file=sys.stderr, flush=True)
    return {**base, "s_per_call": None, "bytes": int(nbytes), "tb_s": None, "share_of_copy": None,
            "error": repr(e)[:1000]}


def rel_err(a, e) -> float:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30))


def gdn_inputs(key, b: int, t: int):
    """Model-like inputs: q, k L2-normalised (q * Dk^-0.5), g < 0, 0 < beta < 1, state ~ N(0, 0.25)."""
    ks = jax.random.split(key, 6)
    l2 = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    q = l2(jax.random.normal(ks[0], (b, t, HK, DK))) * DK ** -0.5
    k = l2(jax.random.normal(ks[1], (b, t, HK, DK)))
    v = jax.random.normal(ks[2], (b, t, HV, DV))
    g = -0.3 * jnp.exp(0.5 * jax.random.normal(ks[3], (b, t, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, HV)))
    state = 0.5 * jax.random.normal(ks[5], (b, HV, DK, DV))
    return q, k, v, g, beta, state


# ---- decode / verify ------------------------------------------------------------------------------

def _decode_time(fn, b: int, sz: Sizes, inputs) -> dict:
    """fn(*inputs, state) -> (o, state'), sz.layers states updated per fori_loop iteration."""
    states = tuple(0.5 * jax.random.normal(jax.random.key(1000 + i), (b, HV, DK, DV)) for i in range(sz.layers))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(carry, inputs):
        def body(i, c):
            sts, acc = c
            new = []
            for s in sts:
                o, s = fn(*inputs, s)
                acc = acc + jnp.sum(o)  # keeps o live (the ref would otherwise skip computing it)
                new.append(s)
            return tuple(new), acc
        return jax.lax.fori_loop(0, sz.iters, body, carry)

    carry, (med, best, first) = _timing(step, (states, jnp.zeros((), jnp.float32)), inputs, sz.repeats)
    calls = sz.layers * sz.iters
    return {"s_per_call": med / calls, "best_s_per_call": best / calls, "first_call_s": first,
            "finite": bool(jnp.isfinite(carry[1])), "layers": sz.layers, "iters": sz.iters}


def _decode_row(base: dict, nbytes: int, fn, args, want, b: int, sz: Sizes, copy_tb_s: float, inputs) -> dict:
    """One decode/verify row: fn's rel_err against want() (the reference's (o, state); None for a
    reference row) on args, then its time (_decode_time); a failure becomes an error row."""
    try:
        extra = {}
        if want is not None:
            ref_o, ref_s = want()
            o, s = jax.jit(fn)(*args)
            extra = {"rel_err_o": rel_err(o, ref_o), "rel_err_state": rel_err(s, ref_s)}
            extra["rel_err"] = max(extra["rel_err_o"], extra["rel_err_state"])
        m = _decode_time(fn, b, sz, inputs)
        return {**base, **_rates(nbytes, m.pop("s_per_call"), copy_tb_s), **extra, **m}
    except Exception as e:
        return _error_row(base, nbytes, e)


def conv_inputs(key, b: int, t: int):
    """The conv kernel's inputs at the 27B shapes: mixed [B, T, C] bf16 (C = 2 Hk Dk + Hv Dv), conv
    state [B, W-1, C], conv weight [C, W], raw gate projections a, b [B, T, Hv], A_log, dt_bias [Hv]
    and n_valid [B] = T (every token valid)."""
    c, width = 2 * HK * DK + HV * DV, 4
    ks = jax.random.split(key, 7)
    mixed = jax.random.normal(ks[0], (b, t, c), jnp.bfloat16)
    conv = jax.random.normal(ks[1], (b, width - 1, c), jnp.bfloat16)
    conv_w = (0.5 * jax.random.normal(ks[2], (c, width))).astype(jnp.bfloat16)
    a, bb = (jax.random.normal(k, (b, t, HV), jnp.bfloat16) for k in ks[3:5])
    a_log = jnp.log(jax.random.uniform(ks[5], (HV,), minval=1.0, maxval=16.0))
    dt_bias = 0.1 * jax.random.normal(ks[6], (HV,))
    return mixed, conv, conv_w, a, bb, a_log, dt_bias, jnp.full((b,), t, jnp.int32)


def parse_conv_config(config: str) -> gdn_conv.RecurrenceConfig:
    """"BVxWARPS" (e.g. "32x4") -> the kernel's config."""
    try:
        bv, warps = map(int, config.split("x"))
    except ValueError:
        raise ValueError(f"gdn conv config {config!r}: want BVxWARPS, e.g. 32x4") from None
    return gdn_conv.RecurrenceConfig(block_v=bv, num_warps=warps)


def _conv_fn(config: str | None, interpret: bool):
    """(conv_inputs..., state) -> (o, state): the conv kernel with a "BVxWARPS" tile config, or the ref
    (None). The state goes last, as _decode_time passes it; the kernel takes it before n_valid."""
    kw = {"key_heads": HK, "scale": DK ** -0.5}
    if config is None:
        return lambda *args: gdn_conv.gdn_conv_recurrence_ref(*args[:-2], args[-1], args[-2], **kw)[:2]
    cfg = parse_conv_config(config)
    return lambda *args: gdn_conv.gdn_conv_recurrence(*args[:-2], args[-1], args[-2], config=cfg,
                                                      interpret=interpret, **kw)[:2]


def bench_conv_decode(copy_tb_s: float, emit, sz: Sizes, configs, with_ref: bool, interpret: bool) -> None:
    for b in sz.batches:
        for t in sz.tokens:
            nbytes = 2 * b * HV * DK * DV * 4
            inputs = conv_inputs(jax.random.key(b * 10 + t), b, t)
            args = (*inputs, 0.5 * jax.random.normal(jax.random.key(7), (b, HV, DK, DV)))
            want = functools.cache(lambda args=args: jax.jit(_conv_fn(None, interpret))(*args))
            for impl, config in [("xla", None)] * with_ref + [("pallas", c) for c in configs]:
                base = {"kernel": "gdn_conv_decode", "case": f"B={b} T={t}", "impl": impl, "B": b, "T": t}
                if config is not None:
                    base["config"] = config
                emit(_decode_row(base, nbytes, _conv_fn(config, interpret), args,
                                 want if config is not None else None, b, sz, copy_tb_s, inputs))


# ---- chunked prefill ------------------------------------------------------------------------------

def chunked_flops_per_token(chunk: int = CHUNK) -> float:
    """Multiply-adds x 2 of gdn_chunked_ref per token, all heads: intra-chunk C x C products (K K^T,
    U, W, Q K^T, the intra-chunk output) and the per-chunk state products (W S, Q S, K^T Vn)."""
    return HV * (2 * chunk * (3 * DK + 2 * DV) + 6 * DK * DV)


def prefill_bytes(b: int, t: int) -> int:
    """f32 state read + written, q, k, v, g, beta read, o written."""
    return 4 * (2 * b * HV * DK * DV + b * t * (2 * HK * DK + 2 * HV * DV + 2 * HV))


def layer_matmuls(x, w):
    """The bf16 matmuls of one 27B GDN decoder layer over x [T, E]: projections, out_proj, MLP."""
    mm = lambda a, m: jnp.einsum("ti,oi->to", a, m, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    qkv, z = mm(x, w["qkv"]), mm(x, w["z"])
    ba = mm(x, w["ba"])
    o = z * jax.nn.sigmoid(qkv[:, :HV * DV]) + ba[:, :1]  # stands in for the GDN output [T, Hv*Dv]
    h = x + mm(o, w["out"])
    return h + mm(jax.nn.silu(mm(h, w["gate"])) * mm(h, w["up"]), w["down"])


def _layer_matmuls_time(t: int, sz: Sizes) -> tuple[float, float]:
    """(seconds, TFLOP/s) of one layer's bf16 matmuls over t tokens, sz.prefill_layers layers per program."""
    key = jax.random.key(t)
    mk = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * 0.02
    e, f = sz.hidden, sz.ffn
    ws = [{"qkv": mk(10 * j, (2 * HK * DK + HV * DV, e)), "z": mk(10 * j + 1, (HV * DV, e)),
           "ba": mk(10 * j + 2, (2 * HV, e)), "out": mk(10 * j + 3, (e, HV * DV)),
           "gate": mk(10 * j + 4, (f, e)), "up": mk(10 * j + 5, (f, e)),
           "down": mk(10 * j + 6, (e, f))} for j in range(sz.prefill_layers)]

    @functools.partial(jax.jit, donate_argnums=0)
    def matmuls(x, ws):
        for w in ws:
            x = layer_matmuls(x, w)
        return x

    _, (med, _, _) = _timing(matmuls, jax.random.normal(key, (t, e), jnp.bfloat16), ws, sz.repeats)
    per_layer = med / sz.prefill_layers
    params = sum(w.size for w in ws[0].values())
    return per_layer, 2 * params * t / per_layer / 1e12


def _prefill_time(fn, t: int, sz: Sizes) -> dict:
    """One jitted program runs fn on sz.prefill_layers distinct layers' inputs and states (donated)."""
    n = sz.prefill_layers
    xs = [gdn_inputs(jax.random.key(100 + i), 1, t) for i in range(n)]

    @functools.partial(jax.jit, donate_argnums=0)
    def program(carry, ins):
        outs = [fn(*x, s) for x, s in zip(ins, carry[0])]
        return tuple(s for _, s in outs), carry[1] + sum(jnp.sum(o) for o, _ in outs)

    carry = (tuple(x[5] for x in xs), jnp.zeros((), jnp.float32))
    _, (med, best, first) = _timing(program, carry, [x[:5] for x in xs], sz.repeats)
    return {"s_per_call": med / n, "best_s_per_call": best / n, "first_call_s": first, "layers_per_program": n}


CHAIN_CONFIGS = ("64x8", "32x4", "16x4", "32x8")  # the chain kernel's sweep, BVxWARPS (the first: the default)


def bench_prefill(copy_tb_s: float, emit, sz: Sizes, chunks=(CHUNK,), interpret: bool = False,
                  chain_configs=CHAIN_CONFIGS[:1]) -> None:
    """One row per prompt length, chunk of the WY form (chunks: candidates for gdn_chunked_ref's chunk) and
    impl: "xla" runs the chain over chunks as a lax.scan (`gdn_chunked_ref`), "pallas" as one kernel
    (`gdn_chunked.gdn_chunked`, one row per config, its rel_err against the xla row's o and state on one
    layer). The layer's matmuls are timed once per length."""
    for t in sz.prefill_tokens:
        nbytes = prefill_bytes(1, t)
        args, mm = gdn_inputs(jax.random.key(100), 1, t), None  # args: one layer's, for the rel_err columns
        for chunk in chunks:
            impls = [("xla", None, functools.partial(gdn_kernel.gdn_chunked_ref, chunk=chunk))]
            impls += [("pallas", c, functools.partial(gdn_chunked.gdn_chunked, chunk=chunk, interpret=interpret,
                                                      config=gdn_chunked.parse_config(c))) for c in chain_configs]
            want = None  # the xla row's o and state
            for impl, config, fn in impls:
                head = _prefill_head(t, chunk, impl, config)
                try:
                    m = _prefill_time(fn, t, sz)
                    s = m.pop("s_per_call")
                    if mm is None:
                        mm = _layer_matmuls_time(t, sz)
                    mm_s, mm_tflops = mm
                    row = {**head, **_rates(nbytes, s, copy_tb_s), **m,
                           "tokens_per_s": t / s, "tokens_per_s_48_layers": t / (GDN_LAYERS * s),
                           "tflops": chunked_flops_per_token(chunk) * t / s / 1e12,
                           "layer_matmuls_s": mm_s, "layer_matmuls_tflops": mm_tflops,
                           "share_of_layer": s / (s + mm_s)}
                    if impl == "pallas":
                        want = jax.jit(impls[0][2])(*args) if want is None else want
                        row["rel_err"] = max(rel_err(a, e) for a, e in zip(jax.jit(fn)(*args), want))
                except Exception as e:
                    row = _error_row(head, nbytes, e)
                emit(row)
            _inputs_rows(copy_tb_s, emit, sz, args, chunk, nbytes)


def _prefill_head(t: int, chunk: int, impl: str, config: str | None) -> dict:
    head = {"kernel": "gdn_prefill", "case": f"B=1 T={t} chunk={chunk}", "impl": impl, "B": 1, "T": t, "chunk": chunk}
    return head if config is None else {**head, "config": config}


def _inputs_rows(copy_tb_s: float, emit, sz: Sizes, args, chunk: int, nbytes: int) -> None:
    """The WY form's chunk-parallel half alone (`gdn.wy_chunk_inputs`, impl "wy_inputs"): how much of a
    kernel row it is. args: one layer's inputs."""
    t = args[0].shape[1]
    fn = functools.partial(gdn_kernel.wy_chunk_inputs, chunk=chunk)
    head = _prefill_head(t, chunk, "wy_inputs", None)

    def summed(q, k, v, g, beta, s):  # what _prefill_time sums, and the state it carries
        return sum(jnp.sum(x) for x in fn(q, k, v, g, beta, s)), s
    try:
        m = _prefill_time(summed, t, sz)
        s = m.pop("s_per_call")
        row = {**head, **_rates(nbytes, s, copy_tb_s), **m, "tokens_per_s": t / s}
    except Exception as e:
        row = _error_row(head, nbytes, e)
    emit(row)


CASES = ("conv", "prefill")


def run(copy_tb_s: float, emit, *, quick: bool = False, interpret: bool = False, cases=CASES, batches=(),
        tokens=(), conv_configs=(), prefill_chunks=(CHUNK,), chain_configs=CHAIN_CONFIGS[:1]) -> None:
    """Times the kernels and their XLA/jnp references at the Qwen3.5-27B shapes; calls emit(row) per
    measured case. cases: a subset of CASES; batches, tokens: the conv case's B and T (default Sizes');
    conv_configs: the conv case's configs (parse_conv_config; default CONV_CONFIGS); prefill_chunks:
    the chunk sizes of the prefill case."""
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise ValueError(f"gdn bench: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    bad = [c for c in prefill_chunks if c < 1 or c & (c - 1)]
    if bad or not prefill_chunks:
        raise ValueError(f"gdn bench: prefill chunks {list(prefill_chunks)}: powers of two, at least one")
    sz = sizes(quick, interpret)
    if batches:
        sz = dataclasses.replace(sz, batches=tuple(batches))
    if tokens:
        sz = dataclasses.replace(sz, tokens=tuple(tokens))
    if conv_configs:
        for c in conv_configs:
            parse_conv_config(c)  # a typo fails before anything runs
        sz = dataclasses.replace(sz, conv_configs=tuple(conv_configs))
    # the ref and the first config everywhere, then prefill, then the rest of the config sweep:
    # whatever a time limit cuts off, the main figures are already emitted
    if "conv" in cases:
        bench_conv_decode(copy_tb_s, emit, sz, sz.conv_configs[:1], with_ref=True, interpret=interpret)
    if "prefill" in cases:
        for c in chain_configs:
            gdn_chunked.parse_config(c)  # a typo fails before anything runs
        bench_prefill(copy_tb_s, emit, sz, tuple(prefill_chunks), interpret, tuple(chain_configs))
    if "conv" in cases:
        bench_conv_decode(copy_tb_s, emit, sz, sz.conv_configs[1:], with_ref=False, interpret=interpret)
