"""The shipped demo model (models/qmtp-demo): what `make demo` promises, checked on the CPU.

Held-out text comes from this machine's own standard library by the training split's rule
(train_data: packages whose name hashes below eval_fraction were never trained on), tokenized with
the checkpoint's tokenizer. An untrained or wrongly exported head scores near 0 here."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from qmtp import api
from qmtp.train import data as train_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "qmtp-demo")
WINDOWS, SEQ_LEN = 8, 256


@pytest.fixture(scope="module")
def demo():
    return api.load(DEMO, dtype="float32", progress=False)


def test_shipped_files_fit_the_repository_limits():
    sizes = {n: os.path.getsize(os.path.join(DEMO, n)) for n in os.listdir(DEMO)}
    assert sum(sizes.values()) <= 20e6 and max(sizes.values()) < 15e6, sizes
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "model.safetensors.index.json"):
        assert name in sizes


@pytest.mark.slow  # CI time: the shipped model's files do not change; its flagfile test stays in CI
def test_heldout_teacher_forced_acceptance_reaches_the_issue_bar(demo):
    # the split's hash holds out whole top-level modules / packages; of Python 3.12's stdlib that is
    # webbrowser.py (~7.3k tokens): windows spread over all of it
    corpus = train_data.load_corpus("stdlib", eval_fraction=0.02)
    stream = train_data.encode_stream(demo.tokenizer, corpus.eval_texts)
    assert stream.size >= 4 * SEQ_LEN
    starts = np.linspace(0, stream.size - SEQ_LEN, WINDOWS).astype(int)
    acceptance = float(np.mean([api.mtp_logits(demo, stream[a:a + SEQ_LEN].tolist()).agreement for a in starts]))
    assert acceptance >= 0.6, acceptance


def test_make_demo_flagfile_writes_the_plain_greedy_code_with_mtp(demo, tmp_path):
    """`make demo`'s command (configs/demo.flags, MTP K=3) in a child process: the plain greedy
    tokens, Python-like text, acceptance statistics and plain-vs-MTP speeds from the one run printed."""
    out = tmp_path / "demo.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "qmtp.generate", "--flagfile=configs/demo.flags", "--max_new_tokens=48",
                        f"--output_json={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mtp_k"] == 3 and "MTP K=3:" in r.stdout and "per-position acceptance" in r.stdout
    assert re.search(r"^plain [\d.]+ tok/s, MTP K=3 [\d.]+ tok/s: [\d.]+x; tokens identical", r.stdout, re.M), r.stdout
    plain = api.generate(demo, report["prompts"], max_new_tokens=48)
    assert report["tokens"] == plain.tokens
    assert all("return" in t or "if " in t for t in report["texts"]), report["texts"]  # code, not noise
    assert report["stats"]["mean_accepted_length"] > 2.0, report["stats"]
