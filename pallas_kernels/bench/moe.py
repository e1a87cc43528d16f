"""The grouped expert matmul (pallas_kernels/moe_matmul.py) at the Qwen3.5-35B-A3B shapes: 256 experts,
hidden 2048, expert width 512, E4M3 weights with 128 x 128 scales; both projections (gate_up [1024, 2048]
and down [2048, 512] per expert).

Cases: "decode" (one token's 8 experts, 8 blocks + 1 unused: the blocks `moe.group_rows` makes for
8 pairs) and "verify" (a K = 3 verify of one sequence: 16 distinct experts among 32 pairs, 34 blocks).
Each call multiplies a new set of experts (64 sets in one jitted fori_loop, 1-2 GB of weights: no L2
reuse, no host dispatch per call). bytes = the used experts' E4M3 weights (scales and x are < 1% of
it); share_of_copy against the copy bandwidth of the same process; rel_err = max |y - y_ref| / max |y_ref|
of the first call in f32 against `expert_matmul_ref`. One row per ExpertMatmulConfig, the
default first; `sweep` adds the candidate tiles (outputs per program, split-K, warps, stages: at decode
a launch has few row blocks, so the programs per block decide how many SMs stream weights).

Case "prefill": a 2048-token prefill chunk routed at random (top-8: 16384 pairs, ~64 per expert), its
pairs grouped into blocks of 16, 32, 64 and 128 rows (each expert's group padded to a block boundary, as
`moe.group_rows` lays them out) with the default tile: taller blocks read each expert's weight fewer
times and feed the tensor cores taller tiles, shorter ones pad less. tflop_s counts the pairs' work
(2 x pairs x O x I); rel_err is taken on the first 8 blocks. Beside them, XLA's grouped GEMM on the same
chunk: `lax.ragged_dot_general` over the pairs sorted by expert (no padding) against every expert's weight
dequantized to bf16 (E4M3 x block scale, in XLA), timed with the dequantize in each call
(xla_dequant_ragged_dot) and on weights dequantized beforehand (xla_ragged_dot: what a prompt's later
chunks pay when a layer's chunks share one dequantize, as the dense prefill's do); rel_err on its first
64 rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import moe_matmul
from pallas_kernels.bench import common
from pallas_kernels.fp8_matmul import dequantize_ref

EXPERTS, HIDDEN, WIDTH = 256, 2048, 512
CASES = {"decode": (8, 9), "verify": (16, 34)}  # (experts used, blocks)
CALLS = 64  # expert sets per timed program
PREFILL_TOKENS, TOP_K = 2048, 8
PREFILL_BLOCK_ROWS = (16, 32, 64, 128)
PREFILL_CALLS = 4


def candidates() -> list[moe_matmul.ExpertMatmulConfig]:
    default = moe_matmul.EXPERT_MATMUL_CONFIG
    grid = [moe_matmul.ExpertMatmulConfig(block_o=b, split_k=s, num_warps=w, num_stages=st)
            for b, s, (w, st) in itertools.product((16, 32, 64), (1, 2, 4), ((4, 3), (4, 2), (2, 3)))]
    return [default] + [c for c in grid if c != default]


def _weights(key, o: int, i: int, experts: int):
    w = (jax.random.normal(key, (experts, o, i)) * 64).clip(-448, 448).astype(jnp.float8_e4m3fn)
    return w, jnp.full((experts, o // 128, i // 128), 1e-4, jnp.float32)


def _expert_sets(used: int, blocks: int, experts: int, calls: int, rng) -> jax.Array:
    """[calls, blocks] int32: each call's block experts, `used` distinct ones then -1 (unused blocks)."""
    sets = [np.concatenate([rng.choice(experts, used, replace=False), -np.ones(blocks - used, int)])
            for _ in range(calls)]
    return jnp.asarray(np.stack(sets), jnp.int32)


def _prefill_sets(tokens: int, experts: int, block_rows: int, calls: int, rng) -> jax.Array:
    """[calls, blocks] int32: the block experts of `tokens` tokens routed at random to TOP_K distinct
    experts each, each expert's pairs from a block boundary (blocks = ceil(pairs / BR) + experts, the
    most any routing needs; the rest -1)."""
    pairs = tokens * min(TOP_K, experts)
    blocks = -(-pairs // block_rows) + experts
    sets = []
    for _ in range(calls):
        chosen = np.stack([rng.choice(experts, min(TOP_K, experts), replace=False) for _ in range(tokens)])
        counts = np.bincount(chosen.reshape(-1), minlength=experts)
        per_expert = np.repeat(np.arange(experts), -(-counts // block_rows))
        sets.append(np.concatenate([per_expert, -np.ones(blocks - per_expert.size, int)]))
    return jnp.asarray(np.stack(sets), jnp.int32)


def _time_config(x, w, s, sets, config, interpret: bool, repeats: int) -> float:
    """Median seconds per call of `sets.shape[0]` calls in one jitted loop (after a warm-up call)."""
    @jax.jit
    def loop(x, w, s, sets):
        def body(c, acc):
            y = moe_matmul.expert_matmul(x, sets[c], w, s, jnp.bfloat16, interpret=interpret, config=config)
            return acc + y[0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, sets.shape[0], body, jnp.float32(0))

    median, _ = common.timed(loop, x, w, s, sets, trials=repeats)
    return median / sets.shape[0]


def run(copy_tb_s: float, emit, *, quick: bool = False, interpret: bool = False, sweep: bool = False) -> None:
    """One row per (projection, case, config); quick / interpret: the default config on small shapes."""
    experts, hidden, width, calls = (16, 256, 128, 2) if interpret else (EXPERTS, HIDDEN, WIDTH, CALLS)
    configs = candidates() if sweep and not quick else [moe_matmul.EXPERT_MATMUL_CONFIG]
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), 2)
    for (proj, (o, i)), key in zip((("gate_up", (2 * width, hidden)), ("down", (hidden, width))), keys):
        w, s = _weights(key, o, i, experts)
        for case, (used, blocks) in CASES.items():
            used, blocks = min(used, experts), min(blocks, experts + 2)
            sets = _expert_sets(used, blocks, experts, calls, rng)
            x = jax.random.normal(key, (blocks * moe_matmul.BLOCK_ROWS, i)).astype(jnp.bfloat16)
            nbytes = used * o * i
            for config in configs:
                base = {"kernel": "moe_expert_matmul", "case": f"{proj} {case}", "impl": "pallas",
                        "config": repr(config), "default": config == moe_matmul.EXPERT_MATMUL_CONFIG}
                try:
                    t = _time_config(x, w, s, sets, config, interpret, 2 if interpret else 7)
                except Exception as e:  # noqa: BLE001 one failing config must not hide the others
                    print(f"moe {proj} {case} {config} failed: {e!r}", file=sys.stderr, flush=True)
                    emit({**base, "error": repr(e)[:1000]})
                    continue
                tb_s = nbytes / t / 1e12
                y = moe_matmul.expert_matmul(x, sets[0], w, s, jnp.float32, interpret=interpret, config=config)
                ref = moe_matmul.expert_matmul_ref(x, sets[0], w, s, jnp.float32)
                err = float(jnp.max(jnp.abs(y - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))
                emit({**base, "s_per_call": t, "bytes": nbytes, "tb_s": tb_s, "share_of_copy": tb_s / copy_tb_s,
                      "rel_err": err,
                      **{f"config_{k}": v for k, v in dataclasses.asdict(config).items()}})
        _prefill(proj, w, s, experts, copy_tb_s, interpret, rng, emit)
        _ragged(proj, w, s, experts, copy_tb_s, interpret, rng, emit)


def _prefill(proj: str, w, s, experts: int, copy_tb_s: float, interpret: bool, rng, emit) -> None:
    """The prefill rows (module doc) of one projection: one row per block height."""
    _, o, i = w.shape
    tokens = 8 if interpret else PREFILL_TOKENS
    for block_rows in PREFILL_BLOCK_ROWS[:1] if interpret else PREFILL_BLOCK_ROWS:
        sets = _prefill_sets(tokens, experts, block_rows, 1 if interpret else PREFILL_CALLS, rng)
        x = jax.random.normal(jax.random.key(block_rows), (sets.shape[1] * block_rows, i)).astype(jnp.bfloat16)
        t = _time_config(x, w, s, sets, None, interpret, 1 if interpret else 5)
        head, head_sets = x[:8 * block_rows], sets[0, :8]
        y = moe_matmul.expert_matmul(head, head_sets, w, s, jnp.float32, interpret=interpret)
        ref = moe_matmul.expert_matmul_ref(head, head_sets, w, s, jnp.float32)
        err = float(jnp.max(jnp.abs(y - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))
        pairs = tokens * min(TOP_K, experts)
        used = float(jnp.mean(jnp.sum(sets >= 0, axis=1)))
        nbytes = int(used * o * i)  # each used block reads its expert's E4M3 weight once
        emit({"kernel": "moe_expert_matmul", "case": f"{proj} prefill {tokens} tok, {block_rows}-row blocks",
              "impl": "pallas", "block_rows": block_rows, "blocks": int(sets.shape[1]), "used_blocks": used,
              "s_per_call": t, "bytes": nbytes, "tb_s": nbytes / t / 1e12,
              "share_of_copy": nbytes / t / 1e12 / copy_tb_s, "tflop_s": 2 * pairs * o * i / t / 1e12, "rel_err": err})


def _ragged(proj: str, w, s, experts: int, copy_tb_s: float, interpret: bool, rng, emit) -> None:
    """XLA's grouped GEMM on a prefill chunk's pairs (module doc): two rows, dequantizing in each call or not."""
    _, o, i = w.shape
    tokens, calls = (8, 1) if interpret else (PREFILL_TOKENS, PREFILL_CALLS)
    top_k = min(TOP_K, experts)
    pairs = tokens * top_k
    group_sizes = jnp.asarray(np.stack([  # [calls, X]: each call's pairs per expert, a new routing each
        np.bincount(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).reshape(-1),
                    minlength=experts) for _ in range(calls)]), jnp.int32)
    x = jax.random.normal(jax.random.key(1), (pairs, i)).astype(jnp.bfloat16)  # [P, I]: pairs by expert
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

    def grouped(x, wb, sizes):  # [P, O] in bf16, f32 accumulation
        return jax.lax.ragged_dot_general(x, wb, sizes, dims, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    @jax.jit
    def calls_of(x, weights, group_sizes):  # weights: (w, s) dequantized in each call, or (bf16 w,)
        def body(c, acc):
            wb = dequantize_ref(*weights, jnp.bfloat16) if len(weights) == 2 else weights[0]
            return acc + grouped(x, wb, group_sizes[c])[0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, group_sizes.shape[0], body, jnp.float32(0))

    wb = jax.jit(dequantize_ref, static_argnums=2)(w, s, jnp.bfloat16)
    head = 64
    rows = jnp.repeat(jnp.arange(experts), group_sizes[0], total_repeat_length=pairs)[:head]  # each row's expert
    ref = jnp.einsum("ri,roi->ro", x[:head].astype(jnp.float32), dequantize_ref(w[rows], s[rows]),
                     precision=jax.lax.Precision.HIGHEST)  # [head, O]
    got = grouped(x, wb, group_sizes[0])[:head].astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))
    trials = 1 if interpret else 5
    for impl, t in (("xla_dequant_ragged_dot", common.timed(calls_of, x, (w, s), group_sizes, trials=trials)[0]),
                    ("xla_ragged_dot", common.timed(calls_of, x, (wb,), group_sizes, trials=trials)[0])):
        t /= calls
        nbytes = experts * o * i * (1 if impl == "xla_dequant_ragged_dot" else 2)  # the E4M3 weights, or bf16
        tb_s = nbytes / t / 1e12
        emit({"kernel": "moe_expert_matmul", "case": f"{proj} prefill {tokens} tok, ragged", "impl": impl,
              "dtype": "bfloat16", "s_per_call": t, "bytes": nbytes, "tb_s": tb_s, "share_of_copy": tb_s / copy_tb_s,
              "tflop_s": 2 * pairs * o * i / t / 1e12, "rel_err": err})
