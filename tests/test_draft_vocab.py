"""Draft vocabularies (qmtp/model/draft_vocab.py, `qmtp.load(..., draft_vocab=...)`): the file checks, and on
the controlled tiny checkpoint (its MTP head predicts the target: 100% acceptance) that a vocabulary
holding every id drafts exactly as the full head does, that one missing the tokens the target emits
drafts none of them right, and that the tokens equal plain greedy decoding either way."""

from __future__ import annotations

import json

import numpy as np
import pytest

import qmtp
from qmtp.model import draft_vocab
from qmtp.tools import make_checkpoint

PROMPTS = [[5, 17, 99, 3, 250, 7], [42, 8, 300, 11]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint.write_checkpoint(str(tmp_path_factory.mktemp("dv") / "ckpt"), "tiny_controlled", "fp32",
                                            seed=4)


@pytest.fixture(scope="module")
def plain(ckpt):
    model = qmtp.load(ckpt, dtype="float32", progress=False)
    return model, qmtp.generate(model, PROMPTS, max_new_tokens=10, stop_token_ids=[])


def test_file_checks_name_the_file_and_the_id(tmp_path):
    good = tmp_path / "v.json"
    good.write_text(json.dumps([7, 3, 5]))
    assert draft_vocab.read(str(good), 10).tolist() == [7, 3, 5]
    (tmp_path / "v.txt").write_text("7 3\n5,9")
    assert draft_vocab.read(str(tmp_path / "v.txt"), 10).tolist() == [7, 3, 5, 9]
    for text, message in [("[1, 12]", "token id 12 outside \\[0, 10\\)"), ("[1, 1]", "token id 1 appears more"),
                          ("[]", "no token ids"), ("1 x", "expected a JSON list"), ("[-1]", "token id -1 outside")]:
        (tmp_path / "bad").write_text(text)
        with pytest.raises(ValueError, match=f"draft vocabulary .*bad: {message}"):
            draft_vocab.read(str(tmp_path / "bad"), 10)
    with pytest.raises(ValueError, match="no such file"):
        draft_vocab.read(str(tmp_path / "missing"), 10)
    assert draft_vocab.padded(np.asarray([4, 2, 9], np.int32), 2).tolist() == [4, 2, 9, 4]


def test_every_id_drafts_as_the_full_head(ckpt, plain):
    model, want = plain
    ids = np.arange(model.cfg.vocab_size)[::-1]  # every id, in another order
    sub = qmtp.load(ckpt, dtype="float32", progress=False, draft_vocab=ids)
    assert sub.params["mtp"]["draft_head"].shape[0] == model.cfg.vocab_size and sub.draft_head == "bf16"
    full = qmtp.generate(model, PROMPTS, max_new_tokens=10, stop_token_ids=[], mtp_k=3)
    got = qmtp.generate(sub, PROMPTS, max_new_tokens=10, stop_token_ids=[], mtp_k=3)
    assert got.tokens == full.tokens == want.tokens
    assert got.stats["accepted"] == full.stats["accepted"] > 0


@pytest.mark.slow  # CI time: test_every_id_drafts_as_the_full_head stays in CI
def test_a_vocabulary_without_the_emitted_tokens_drafts_nothing_right(ckpt, plain, tmp_path):
    model, want = plain
    emitted = {t for row in want.tokens for t in row}
    ids = [i for i in range(model.cfg.vocab_size) if i not in emitted]
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(ids))
    sub = qmtp.load(ckpt, dtype="float32", progress=False, draft_vocab=str(path))
    got = qmtp.generate(sub, PROMPTS, max_new_tokens=10, stop_token_ids=[], mtp_k=3)
    assert got.tokens == want.tokens
    assert got.stats["accepted"] == 0 and got.stats["drafted"] > 0
    logits = qmtp.mtp_logits(sub, PROMPTS[0])
    draft = np.asarray(logits.logits)
    outside = np.ones(model.cfg.vocab_size, bool)
    outside[ids] = False
    assert np.all(np.isneginf(draft[:, outside])) and np.all(np.isfinite(draft[:, ids]))


def test_hot_vocab_script_counts_text_and_keeps_the_stop_ids(ckpt, tmp_path):
    """scripts/hot_vocab.py on the tiny checkpoint's tokenizer: the most frequent ids of the text,
    the end-of-sequence ids first, a file qmtp.load accepts."""
    import subprocess
    import sys
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. the end. " * 20)
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, "scripts/hot_vocab.py", f"--checkpoint={ckpt}", "--size=6", f"--out={out}",
                        str(text)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ids = json.loads(out.read_text())
    cfg = qmtp.load(ckpt, dtype="float32", progress=False).cfg
    assert len(ids) == 6 and ids[:len(cfg.eos_token_ids)] == list(cfg.eos_token_ids)
    tok = qmtp.load(ckpt, dtype="float32", progress=False).tokenizer
    the = tok.encode("the cat sat on the mat. the end. ").ids
    most = max(set(the), key=lambda i: (the.count(i), -i))
    assert most in ids
    assert draft_vocab.read(str(out), cfg.vocab_size).tolist() == ids
