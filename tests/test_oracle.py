"""Parity with HF transformers (the independent oracle) on committed tiny random checkpoints.

The fixtures come from scripts/make_oracle_fixtures.py (Python 3.11 + torch + transformers):
Qwen3.5 in the released nested layout (untied) and Qwen3-Next with fused GDN projections (tied),
float32, with HF's teacher-forced logits and greedy continuations.
"""

import os

import numpy as np
import pytest

import qmtp
from tolerance import F32_MODEL, assert_close

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "oracle")
NAMES = ["qwen3_5", "qwen3_next"]


@pytest.fixture(scope="module", params=NAMES)
def oracle(request):
    path = os.path.join(FIXTURES, request.param)
    return request.param, qmtp.load(path, dtype="float32"), np.load(os.path.join(path, "expected.npz"))


def test_teacher_forced_logits_match_hf(oracle):
    name, model, expected = oracle
    for i in range(3):  # prompt lengths 5, 19, 70 (70 > the 64-token GDN chunk)
        logits = qmtp.target_logits(model, expected[f"prompt_{i}"].tolist())
        assert_close(logits, expected[f"logits_{i}"], F32_MODEL, f"{name} prompt {i} logits")


def test_greedy_continuation_matches_hf_generate(oracle):
    name, model, expected = oracle
    prompts = [expected[f"prompt_{i}"].tolist() for i in range(2)]
    result = qmtp.generate(model, prompts, max_new_tokens=12, stop_token_ids=[])
    for i in range(2):
        assert result.tokens[i] == expected[f"greedy_{i}"].tolist(), f"{name} prompt {i}"
