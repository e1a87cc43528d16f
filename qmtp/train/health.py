"""Is a trained model degenerate? Checked on held-out text before its MTP acceptance is reported.

A target that always predicts the same token agrees with its own MTP head at every position (the
head learns to predict that token too), so a collapsed model reports a teacher-forced acceptance of
1.000. The acceptance of such a model says nothing about drafting; `check` tells it apart with two
criteria, either of which makes the model degenerate:

    no better than frequencies   held-out target loss >= the unigram loss of the same positions: the
                                 mean of -log f(x_{p+1}), f the token frequencies of the whole held-out
                                 stream (`unigram_loss`). f is fitted to the held-out text itself, so
                                 this is the best any context-free predictor can do there; a model that
                                 does not beat it learned nothing beyond token frequencies.
    collapsed output             the most common greedy (argmax) prediction covers more than
                                 TOP_SHARE_LIMIT = 95% of the held-out positions. Source code's most
                                 frequent token (a space or a newline) is well under half of it, and a
                                 model that has learned anything predicts many different tokens.

The loss criterion compares paired numbers (same positions), so it needs no margin: a model that
learned the training frequencies exactly lands above the line by their divergence from the held-out
ones.
"""

from __future__ import annotations

import numpy as np

TOP_SHARE_LIMIT = 0.95  # collapsed: the modal greedy prediction covers more than this share of positions


def unigram_loss(reference: np.ndarray, labels: np.ndarray) -> float:
    """Mean -log f(label) in nats over `labels`, f the token frequencies of `reference` (1-D ids); every
    label must occur in `reference` (the trainer passes the held-out stream its windows come from)."""
    reference, labels = np.asarray(reference).ravel(), np.asarray(labels).ravel()
    size = int(max(reference.max(), labels.max())) + 1
    counts = np.bincount(reference, minlength=size).astype(np.float64)
    if not counts[labels].all():
        raise ValueError("unigram_loss: a label does not occur in the reference tokens")
    return float(np.mean(np.log(counts.sum()) - np.log(counts[labels])))


def check(loss: float, labels: np.ndarray, predictions: np.ndarray, reference: np.ndarray,
          tokenizer=None) -> dict:
    """The module's criteria for a model whose mean held-out target loss over the positions predicting
    `labels` is `loss` and whose greedy predictions there are `predictions` (same shape as labels).

    Returns {"loss", "unigram", "top_token", "top_token_text" (with a tokenizer), "top_share",
    "degenerate"}: degenerate is None for a healthy model, else the list of the criteria it fails,
    each a sentence with its numbers."""
    labels, predictions = np.asarray(labels).ravel(), np.asarray(predictions).ravel()
    if labels.shape != predictions.shape or not labels.size:
        raise ValueError(f"check: {labels.size} labels and {predictions.size} predictions")
    ids, counts = np.unique(predictions, return_counts=True)
    top, share = int(ids[np.argmax(counts)]), float(np.max(counts) / predictions.size)
    text = repr(tokenizer.decode([top])) if tokenizer is not None else None
    out = {"loss": float(loss), "unigram": unigram_loss(reference, labels), "top_token": top,
           "top_token_text": text, "top_share": share}
    reasons = []
    if not out["loss"] < out["unigram"]:  # NaN fails too
        reasons.append(f"held-out loss {out['loss']:.3f} >= unigram {out['unigram']:.3f} (no better than token "
                       "frequencies)")
    if share > TOP_SHARE_LIMIT:
        reasons.append(f"{100 * share:.0f}% of greedy predictions are token {top}" + (f" ({text})" if text else ""))
    out["degenerate"] = reasons or None
    return out


def describe(result: dict, acceptance: float | None = None) -> str:
    """One line for the run's report: the verdict of `check` and, when given, the MTP acceptance (marked
    as not meaningful for a degenerate model)."""
    if result["degenerate"]:
        tail = "its MTP acceptance" + (f" ({acceptance:.3f})" if acceptance is not None else "")
        return f"DEGENERATE MODEL: {'; '.join(result['degenerate'])}; {tail} is not meaningful"
    line = (f"held-out loss {result['loss']:.3f} < unigram {result['unigram']:.3f}; the most common greedy "
            f"prediction covers {100 * result['top_share']:.0f}% of positions")
    return line + (f"; MTP acceptance {acceptance:.3f}" if acceptance is not None else "")
