"""Parity with HF transformers (the independent oracle) on committed tiny random checkpoints.

The fixtures come from scripts/make_oracle_fixtures.py (Python 3.11 + torch + transformers):
Qwen3.5 in the released nested layout (untied) and Qwen3-Next with fused GDN projections (tied), each
dense and mixture-of-experts (Qwen3.5-MoE with fused expert tensors; Qwen3-Next MoE with one tensor per
expert, unnormalized top-k weights and a dense layer), float32, with HF's teacher-forced logits and greedy
continuations.
"""

import dataclasses
import functools
import os

import numpy as np
import pytest

import qmtp
from tolerance import F32_MODEL, assert_close

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "oracle")
NAMES = ["qwen3_5", "qwen3_next", "qwen3_5_moe", "qwen3_next_moe"]
# the long prompt through qwen3_next and the MoE fixtures (their chunked prefill is qwen3_5's) is left to `slow`
LONG = NAMES[:1] + [pytest.param(name, marks=pytest.mark.slow) for name in NAMES[1:]]


@functools.cache
def _load(name: str):
    path = os.path.join(FIXTURES, name)
    return name, qmtp.load(path, dtype="float32"), np.load(os.path.join(path, "expected.npz"))


@pytest.fixture(scope="module", params=NAMES)
def oracle(request):
    return _load(request.param)


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


@pytest.mark.parametrize("name", LONG)
def test_long_prompt_matches_hf_in_one_pass_and_in_chunks(name):
    """A 2,100-token prompt: the one-pass logits at every 100th position and the last 4, and the greedy
    continuation after a prefill in 512-token chunks (8 of them over the 4,096-token bucket), plain and MTP."""
    name, model, expected = _load(name)
    ids = expected["long_prompt"].tolist()
    logits = qmtp.target_logits(model, ids)
    assert_close(logits[expected["long_positions"]], expected["long_logits"], F32_MODEL, f"{name} long prompt logits")
    chunked = dataclasses.replace(model, kernels=dataclasses.replace(model.kernels, prefill_chunk=512))
    for k in (0, 2):
        tokens = qmtp.generate(chunked, [ids], max_new_tokens=12, stop_token_ids=[], mtp_k=k).tokens[0]
        assert tokens == expected["long_greedy"].tolist(), f"{name} long prompt, K={k}"
