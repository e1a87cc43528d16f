#!/usr/bin/env python3
"""A draft vocabulary from text: the checkpoint's tokenizer counts token ids over the given files and
the --size most frequent go out as a JSON list, most frequent first (ties: lower id first), with the
model's end-of-sequence ids (config / generation_config.json) always included. Use it with `--draft_vocab=FILE` on
generate / bench / server, and measure what it costs in acceptance on held-out text (not the text
counted here), e.g. `python -m qmtp.bench --checkpoint=DIR --prompt_text=... --draft_vocab=FILE` with and
without the file (natural acceptance per position).

  PYTHONPATH=. python scripts/hot_vocab.py --checkpoint=DIR --size=32768 --out=vocab.json corpus/*.txt
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

flags.DEFINE_string("checkpoint", None, "Checkpoint directory (tokenizer.json, config.json).", required=True)
flags.DEFINE_integer("size", 32768, "Token ids to keep.", lower_bound=1)
flags.DEFINE_string("out", None, "Output JSON file.", required=True)
FLAGS = flags.FLAGS


def hot_ids(counts: np.ndarray, size: int, always=()) -> list[int]:
    """The `size` ids with the highest counts (ties: lower id first), `always` included first."""
    order = np.lexsort((np.arange(counts.size), -counts))  # by count descending, then id ascending
    keep = [int(i) for i in always if 0 <= int(i) < counts.size]
    seen = set(keep)
    for i in order:
        if len(keep) >= size:
            break
        if int(i) not in seen:
            keep.append(int(i))
            seen.add(int(i))
    return keep


def main(argv) -> int:
    files = argv[1:]
    if not files:
        print("hot_vocab: give one or more text files to count", file=sys.stderr)
        return 2
    from qmtp import api
    from qmtp.model.config import ModelConfig
    tokenizer = api._load_tokenizer(FLAGS.checkpoint)
    if tokenizer is None:
        print(f"hot_vocab: {FLAGS.checkpoint} has no tokenizer.json", file=sys.stderr)
        return 2
    cfg = ModelConfig.from_hf(FLAGS.checkpoint)
    counts = np.zeros(cfg.vocab_size, np.int64)
    total = 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = np.asarray(tokenizer.encode(f.read()).ids, np.int64)
        ids = ids[ids < cfg.vocab_size]
        counts += np.bincount(ids, minlength=cfg.vocab_size)
        total += ids.size
    keep = hot_ids(counts, min(FLAGS.size, cfg.vocab_size), cfg.eos_token_ids)
    with open(FLAGS.out, "w") as f:
        json.dump(keep, f)
    covered = counts[keep].sum() / max(total, 1)
    print(f"{FLAGS.out}: {len(keep)} of {cfg.vocab_size} ids cover {100 * covered:.2f}% of the {total} counted tokens")
    return 0


if __name__ == "__main__":
    app.run(main)
