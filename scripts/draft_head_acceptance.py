"""Teacher-forced first-draft acceptance of a checkpoint's MTP head with the bf16 lm_head and with
the FP8 draft head (`qmtp.load(..., draft_head="fp8")`), on the same held-out windows: what the FP8
copy costs in acceptance, to weigh against the bytes it saves per draft; with --draft_vocab also
the FP8 head restricted to a draft vocabulary (`qmtp.load(..., draft_vocab=FILE)`).

For each window of SEQ_LEN tokens, `qmtp.api.mtp_logits` gives the draft's argmax at every position
from the target's hidden state and the true next token; acceptance = share of positions where it
equals the target's own argmax. Also printed: the share of positions where the two heads' draft
argmaxes differ at all.

  PYTHONPATH=. python scripts/draft_head_acceptance.py --checkpoint=models/qmtp-demo
  PYTHONPATH=. python scripts/draft_head_acceptance.py --checkpoint=DIR --text_file=held_out.txt

Without --text_file the held-out text is the training split's held-out stdlib modules
(`qmtp.train_data`, the text `tests/test_demo_model.py` scores), which suits the demo model only.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from absl import app, flags

flags.DEFINE_string("checkpoint", "models/qmtp-demo", "Checkpoint directory (with tokenizer.json).")
flags.DEFINE_string("text_file", None, "Held-out text to score (default: the demo's held-out stdlib modules).")
flags.DEFINE_integer("windows", 16, "Windows spread evenly over the text.", lower_bound=1)
flags.DEFINE_integer("seq_len", 256, "Tokens per window.", lower_bound=3)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
flags.DEFINE_string("draft_vocab", None, "Also score the FP8 head restricted to this draft vocabulary (a file of "
                    "token ids, qmtp/draft_vocab.py; scripts/hot_vocab.py builds one).")
flags.DEFINE_string("output_json", None, "Also write the figures here.")
FLAGS = flags.FLAGS


def _held_out_tokens(tokenizer) -> np.ndarray:
    from qmtp import train_data
    if FLAGS.text_file:
        with open(FLAGS.text_file, encoding="utf-8") as f:
            return np.asarray(tokenizer.encode(f.read()).ids, np.int32)
    corpus = train_data.load_corpus("stdlib", eval_fraction=0.02)
    return train_data.encode_stream(tokenizer, corpus.eval_texts)


def main(argv) -> int:
    del argv
    from qmtp import api
    models = {head: api.load(FLAGS.checkpoint, dtype=FLAGS.dtype, progress=False, draft_head=head)
              for head in ("bf16", "fp8")}
    if FLAGS.draft_vocab:
        models["fp8_vocab"] = api.load(FLAGS.checkpoint, dtype=FLAGS.dtype, progress=False, draft_head="fp8",
                                       draft_vocab=FLAGS.draft_vocab)
    stream = _held_out_tokens(models["bf16"].tokenizer)
    if stream.size < FLAGS.seq_len:
        print(f"{FLAGS.text_file or 'held-out text'}: {stream.size} tokens, fewer than --seq_len={FLAGS.seq_len}",
              file=sys.stderr)
        return 2
    starts = np.linspace(0, stream.size - FLAGS.seq_len, FLAGS.windows).astype(int)
    hits = {head: [] for head in models}
    differ = []
    for a in starts:
        window = stream[a:a + FLAGS.seq_len].tolist()
        out = {head: api.mtp_logits(m, window) for head, m in models.items()}
        for head, r in out.items():
            hits[head].append(r.draft_argmax == r.target_argmax)
        differ.append(out["bf16"].draft_argmax != out["fp8"].draft_argmax)
    result = {"checkpoint": FLAGS.checkpoint, "positions": int(sum(h.size for h in hits["bf16"])),
              "acceptance": {head: float(np.mean(np.concatenate(h))) for head, h in hits.items()},
              "draft_argmax_differs": float(np.mean(np.concatenate(differ)))}
    print(f"{result['positions']} positions: first-draft acceptance bf16 head {result['acceptance']['bf16']:.4f}, "
          f"FP8 head {result['acceptance']['fp8']:.4f}; the heads' draft argmax differs at "
          f"{100 * result['draft_argmax_differs']:.2f}% of positions")
    if "fp8_vocab" in result["acceptance"]:
        print(f"FP8 head over the draft vocabulary {FLAGS.draft_vocab}: {result['acceptance']['fp8_vocab']:.4f}")
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    app.run(main)
