"""python -m qmtp.bench.exactness: every mode against plain decoding at batch 1."""

import json
import os
import subprocess
import sys

import pytest

from qmtp.bench.exactness import first_difference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) == -1
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a shorter run differs where it ends


@pytest.mark.slow  # CI time: float32 exactness in test_speculate.py; the harness's comparison in the test above
def test_float32_modes_give_plain_batch1_tokens(tmp_path):
    """In float32 MTP and batching keep the greedy tokens (the documented guarantee): the harness runs
    every mode on real-text prompts and reports them exact, exit status 0."""
    out = tmp_path / "exact.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "qmtp.bench.exactness", "--checkpoint=models/qmtp-demo",
                        "--dtype=float32", "--prompts=2", "--prompt_tokens=16", "--max_new_tokens=24", "--batch=1,2",
                        "--ks=2", f"--out={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "EXACT: every mode gives plain batch-1 tokens" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch"], row["k"]) for row in rows] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    assert all(row["first_difference"] == [-1, -1] and len(row["tokens"][0]) == 24 for row in rows)
