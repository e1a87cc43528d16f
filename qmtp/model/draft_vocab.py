"""A draft vocabulary: MTP drafts choose among a subset of token ids (SGLang's "speculative token
map"; FR-Spec's frequency-ranked draft vocabulary). The draft head is `lm_head[ids]` ([Vs, E], FP8
when the draft head is) and a draft is ids[argmax(logits over the subset)], so a draft step reads
Vs / V of the head. The verify pass keeps the full lm_head: tokens never change, only acceptance may.
`scripts/hot_vocab.py` builds one from text. File format: a JSON list of token ids, or text with ids
separated by whitespace or commas.
"""

from __future__ import annotations

import json
import os

import numpy as np


def read(path: str, vocab_size: int) -> np.ndarray:
    """Token ids [Vs] int32 from `path`, in file order; ValueError naming the file for anything that
    is not a non-empty list of distinct ids in [0, vocab_size)."""
    if not os.path.isfile(path):
        raise ValueError(f"draft vocabulary {path}: no such file")
    with open(path) as f:
        text = f.read()
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else text.replace(",", " ").split()
        ids = np.asarray([int(v) for v in values], np.int64)
    except (ValueError, TypeError) as e:
        raise ValueError(f"draft vocabulary {path}: expected a JSON list of token ids or whitespace-separated "
                         f"ids ({e})") from None
    return validate(ids, vocab_size, f"draft vocabulary {path}")


def validate(ids, vocab_size: int, name: str = "draft vocabulary") -> np.ndarray:
    """ids as int32 [Vs] after the checks `read` makes (name: what an error message calls them)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError(f"{name}: no token ids")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"{name}: token id {int(bad[0])} outside [0, {vocab_size}) (the model's vocab_size)")
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{name}: token id {int(uniq[counts > 1][0])} appears more than once")
    return ids.astype(np.int32)


def padded(ids: np.ndarray, multiple: int) -> np.ndarray:
    """ids padded to a multiple of `multiple` rows (the vocabulary-parallel head splits evenly) by
    repeating ids[0]: a repeated row can only tie its original, and both map to the same token."""
    pad = -len(ids) % multiple
    return np.concatenate([ids, np.full((pad,), ids[0], np.int32)]) if pad else ids
