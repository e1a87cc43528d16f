"""Do MTP and batching keep greedy tokens exact? python -m qmtp.bench.exactness --checkpoint=models/qmtp-demo

Decodes the same prompts greedily in every mode asked for: plain decoding and MTP with each --ks, at
each --batch size (the prompts in consecutive groups of that size), for each --page_sizes, and compares
every prompt's tokens with plain decoding at batch 1 on the first page size. Greedy decoding is
exact only if each row's numbers do not depend on how many rows share a launch (a verify computes K+1
rows per sequence, a batch B rows): one rounding difference turns a near-tie and the text parts.

The prompts are real text where a trained model has near-ties: windows of Python source from the
standard library (the trainer's held-out packages first), --prompt_tokens long. Prints one line per
mode (prompts that differ, and the first differing token of each) and exits 1 when any differs.
"""

from __future__ import annotations

import json
import sys

from absl import flags

from qmtp import cli_help, cli_progress

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags (defined on use, so importing the module defines none)."""
    flags.DEFINE_string("checkpoint", "models/qmtp-demo", "Checkpoint directory or preset:NAME[:DTYPE] (needs mtp.* "
                        "tensors for --ks).")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
    flags.DEFINE_enum("impl", "ref", ["ref", "pallas"], "Kernel implementation (pallas: interpret mode on a CPU).")
    cli_help.define_deterministic_flag()
    flags.DEFINE_integer("num_layers", None, "Presets only: a slice with this many decoder layers (default: all).",
                         lower_bound=1)
    flags.DEFINE_integer("prompts", 12, "Number of prompts.", lower_bound=1)
    flags.DEFINE_integer("prompt_tokens", 32, "Tokens per prompt.", lower_bound=1)
    flags.DEFINE_integer("max_new_tokens", 256, "Tokens generated per prompt (no stop token: every mode runs the full "
                         "length).", lower_bound=1)
    flags.DEFINE_list("batch", ["1", "8"], "Batch sizes.")
    flags.DEFINE_list("ks", ["1", "2", "3", "4"], "MTP drafts per round to compare (plain decoding always runs).")
    flags.DEFINE_list("page_sizes", ["16"], "KV-cache page sizes.")
    flags.DEFINE_string("out", None, "Write every mode's tokens and first differences to this JSON file.")


def source_prompts(tokenizer, vocab_size: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n windows of `length` token ids of Python source (held-out stdlib packages first, then the rest),
    one per file, from each file's start; with no tokenizer, n seeded random id sequences."""
    import numpy as np
    if tokenizer is None:
        return np.random.default_rng(seed).integers(0, vocab_size, (n, length)).tolist()
    from qmtp.train import data
    corpus = data.load_corpus("stdlib", eval_fraction=0.02)
    out = []
    for text in corpus.eval_texts + corpus.train_texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            return out
    raise ValueError(f"the standard library has fewer than {n} files of {length} tokens")


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where a and b differ (-1: identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1 if len(a) == len(b) else min(len(a), len(b)))


def positive_ints(flag: str) -> list[int]:
    values = FLAGS[flag].value
    if not values or not all(v.isdigit() and int(v) > 0 for v in values):
        raise ValueError(f"--{flag}={','.join(values)}: expected comma-separated positive integers")
    return [int(v) for v in values]


def decode_all(model, prompts, batch: int, k: int) -> list[list[int]]:
    import qmtp
    tokens = []
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        tokens += qmtp.generate(model, group, max_new_tokens=FLAGS.max_new_tokens, stop_token_ids=[],
                                mtp_k=k).tokens
    return tokens


def run() -> int:
    import qmtp
    from qmtp.tools import make_checkpoint
    batches, ks, pages = (positive_ints(name) for name in ("batch", "ks", "page_sizes"))
    cli_help.check_output_file("out", FLAGS.out)
    path = make_checkpoint.resolve_checkpoint(FLAGS.checkpoint, num_layers=FLAGS.num_layers)
    phases = cli_progress.Phases("exactness")
    reference, rows = None, []
    engine = f"{FLAGS.impl}{' deterministic' if FLAGS.deterministic else ''}"
    for page in pages:
        phases(f"loading {FLAGS.checkpoint} ({FLAGS.dtype}, {engine}, page size {page})", tick=False)
        model = qmtp.load(path, dtype=FLAGS.dtype, impl=FLAGS.impl, page_size=page, progress=False,
                          deterministic=FLAGS.deterministic)
        prompts = source_prompts(model.tokenizer, model.cfg.vocab_size, FLAGS.prompts, FLAGS.prompt_tokens)
        for batch in batches:
            for k in [0] + ks:
                phases(f"page size {page}, batch {batch}, {'MTP K=%d' % k if k else 'plain'}")
                tokens = decode_all(model, prompts, batch, k)
                if reference is None:
                    reference = tokens
                diffs = [first_difference(t, r) for t, r in zip(tokens, reference)]
                rows.append({"page_size": page, "batch": batch, "k": k, "first_difference": diffs, "tokens": tokens})
    phases.done()
    n_bad = 0
    print(f"{FLAGS.checkpoint}, {FLAGS.dtype}, {engine}: {FLAGS.prompts} prompts x {FLAGS.max_new_tokens} tokens, "
          f"each against plain decoding at batch 1, page size {pages[0]}")
    for row in rows:
        differ = [(i, d) for i, d in enumerate(row["first_difference"]) if d >= 0]
        n_bad += bool(differ)
        mode = f"MTP K={row['k']}" if row["k"] else "plain"
        where = ", ".join(f"prompt {i} at token {d}" for i, d in differ) or "all identical"
        print(f"page {row['page_size']:3d}  batch {row['batch']:2d}  {mode:9s}  {len(differ):2d} differ: {where}")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"checkpoint": FLAGS.checkpoint, "dtype": FLAGS.dtype, "impl": FLAGS.impl,
                       "deterministic": FLAGS.deterministic, "rows": rows}, f)
    print("EXACT: every mode gives plain batch-1 tokens" if not n_bad else f"NOT EXACT: {n_bad} modes differ")
    return 1 if n_bad else 0


def main(argv):
    from qmtp.model.checkpoint import CheckpointError
    from qmtp.model.config import ConfigError
    del argv
    try:
        sys.exit(run())
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    define_flags()
    cli_help.run(main, __doc__)
