"""Sampling's device work per call at the Qwen3.5 vocabulary, piece by piece, against greedy's argmax:

    python -m qmtp.bench.sampling_ops [--rows=1,4,16] [--vocab=248320] [--k=3] [--out=sampling_ops.json]
    python -m qmtp.bench.sampling_ops --quick        (a CPU smoke run: a small vocabulary, few calls)

Beyond a greedy round, a sampled MTP round computes each of its K drafts' processed distribution
(`sampling.logprobs`: temperature, the top_k / top_p / min_p cut, log_softmax) and draws the draft
(`gumbel_argmax`), the verify's K+1 processed distributions, and the acceptance (`speculative_accept`).
Each piece is timed alone inside one jitted fori_loop of --iters calls whose inputs change every
iteration (nothing is hoisted), so a jitted call's dispatch (~85 us on the H200) is spread over them:
us per call = median wall time of --trials loops / iters. The settings: Qwen's recommended ones
(T 0.6, top_p 0.95, top_k 20: the cut found among the SHORT_TOP_K largest), T 0.6 alone (no cut) and
top_p 0.95 alone (the cut found by sorting the vocabulary). The `round` rows hold all of a K round's
sampling work at the recommended settings against a greedy round's argmaxes (K drafts, the verify's
K+1 positions): their difference is what sampling adds to a round's device time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from qmtp import cli_help, sampling_args
from qmtp.runtime import sampling as smp

QWEN3_5_VOCAB = 248320


def define_flags() -> None:
    """The command line's flags (defined when run as a program: other bench modules share some names)."""
    flags.DEFINE_list("rows", ["1", "4", "16"], "Batch rows per call (each its own set of rows).")
    flags.DEFINE_integer("vocab", QWEN3_5_VOCAB, "Vocabulary size V.", lower_bound=2)
    flags.DEFINE_integer("k", 3, "Drafts per round of the round rows.", lower_bound=1)
    flags.DEFINE_integer("iters", 50, "Calls per timed loop.", lower_bound=1)
    flags.DEFINE_integer("trials", 5, "Timed loops per piece (the median counts).", lower_bound=1)
    flags.DEFINE_boolean("quick", False, "A CPU smoke run: vocabulary 4096, rows 1 and 4, 2 calls per loop, "
                         "1 trial.")
    flags.DEFINE_string("out", "sampling_ops.json", "Where to write the JSON rows.")


def settings(rows: int) -> dict[str, smp.SamplingParams]:
    """The three sampling settings of the module doc, each the same for every row."""
    def params(top_k: int, top_p: float) -> smp.SamplingParams:
        return sampling_args.sampling_params(rows, 0.6, top_k, top_p, seed=np.arange(rows))
    return {"recommended": params(20, 0.95), "temperature": params(0, 1.0), "top_p": params(0, 0.95)}


def pieces(rows: int, k: int) -> dict:
    """name -> fn(z [R, V], zk [R, K+1, V], i) of each timed piece (i: the loop index, for the keys)."""
    cuts = settings(rows)
    rec = cuts["recommended"]
    base = jnp.full((rows,), 100, jnp.int32)

    def keys(i):
        return smp.keys(rec.seed, base + i, smp.DRAFT)

    def sampled_round(z, zk, i):
        q, drafts = [], []
        for step in range(k):  # the drafts: each from its own head output (here: z shifted)
            q.append(smp.logprobs(z + step, rec))
            drafts.append(smp.gumbel_argmax(q[-1], keys(i + step)))
        p = smp.logprobs(zk, rec)  # the verify's K+1 positions
        return smp.speculative_accept(p, jnp.stack(q, axis=1), jnp.stack(drafts, axis=1), rec.seed, base + i)

    def greedy_round(z, zk, i):
        drafts = [jnp.argmax(z + step, axis=-1) for step in range(k)]
        return jnp.stack(drafts, axis=1), jnp.argmax(zk, axis=-1)

    out = {"argmax": lambda z, zk, i: jnp.argmax(z, axis=-1),
           "largest_64": lambda z, zk, i: smp.largest(z, smp.SHORT_TOP_K),
           "gumbel_argmax": lambda z, zk, i: smp.gumbel_argmax(z, keys(i))}
    for name, cut in cuts.items():
        out[f"logprobs_{name}"] = lambda z, zk, i, cut=cut: smp.logprobs(z, cut)
    out[f"logprobs_{k + 1}_positions"] = lambda z, zk, i: smp.logprobs(zk, rec)
    out["speculative_accept"] = lambda z, zk, i: smp.speculative_accept(
        zk, zk[:, :k] - 0.1, jnp.argmax(zk[:, :k], axis=-1), rec.seed, base + i)
    out["round_sampled"] = sampled_round
    out["round_greedy"] = greedy_round
    return out


def time_piece(fn, z, zk, iters: int, trials: int) -> float:
    """Seconds per call of fn inside one jitted loop of `iters` calls (module doc)."""
    @jax.jit
    def loop(z, zk):
        def body(i, acc):
            outs = fn(z + i.astype(z.dtype) * 1e-3, zk + i.astype(zk.dtype) * 1e-3, i)
            return acc + sum(jnp.ravel(o)[0].astype(jnp.float32) for o in jax.tree_util.tree_leaves(outs))
        return jax.lax.fori_loop(0, iters, body, jnp.zeros((), jnp.float32))

    loop(z, zk).block_until_ready()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        loop(z, zk).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / iters


def run(rows_list, vocab: int, k: int, iters: int, trials: int, show=print) -> list[dict]:
    """One row per piece and batch rows: {"piece", "rows", "vocab", "k", "us_per_call"}; per batch rows,
    a `round_extra` row: round_sampled - round_greedy."""
    out = []
    for rows in rows_list:
        key = jax.random.key(rows)
        z = 3.0 * jax.random.normal(key, (rows, vocab), jnp.float32)  # logits of a confident head
        zk = 3.0 * jax.random.normal(jax.random.fold_in(key, 1), (rows, k + 1, vocab), jnp.float32)
        us = {}
        for name, fn in pieces(rows, k).items():
            us[name] = 1e6 * time_piece(fn, z, zk, iters, trials)
            out.append({"piece": name, "rows": rows, "vocab": vocab, "k": k, "us_per_call": us[name]})
            show(f"rows {rows:3d}  {name:24s} {us[name]:9.1f} us")
        extra = us["round_sampled"] - us["round_greedy"]
        out.append({"piece": "round_extra", "rows": rows, "vocab": vocab, "k": k, "us_per_call": extra})
        show(f"rows {rows:3d}  {'round_extra':24s} {extra:9.1f} us  (what sampling adds to a K={k} round)")
    return out


def main(argv) -> int:
    del argv
    try:
        rows_list = [int(r) for r in FLAGS.rows]
        if not rows_list or min(rows_list) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --rows={','.join(FLAGS.rows)}: expected positive integers", file=sys.stderr)
        return 2
    try:
        cli_help.check_output_file("out", FLAGS.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    vocab, iters, trials = FLAGS.vocab, FLAGS.iters, FLAGS.trials
    if FLAGS.quick:
        rows_list, vocab, iters, trials = [1, 4], 4096, 2, 1
    print(f"{jax.devices()[0].device_kind}: vocabulary {vocab}, K={FLAGS.k}, {iters} calls per loop", flush=True)
    rows = run(rows_list, vocab, FLAGS.k, iters, trials, show=lambda line: print(line, flush=True))
    with open(FLAGS.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=2)
    return 0


FLAGS = flags.FLAGS

if __name__ == "__main__":
    define_flags()
    cli_help.run(lambda argv: sys.exit(main(argv)), __doc__, __name__)
