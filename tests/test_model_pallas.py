"""The model with impl="pallas" (kernels in interpret mode on the CPU) against impl="ref"."""

import dataclasses
import os

import numpy as np
import pytest

import qmtp
from tolerance import F32_MODEL, assert_close

ORACLE = os.path.join(os.path.dirname(__file__), "fixtures", "oracle", "qwen3_5")


@pytest.mark.slow  # ~15 s; the FP8 test below runs the same Pallas model path (logits and MTP tokens) in CI
def test_pallas_impl_matches_ref_logits_and_mtp_tokens():
    ref = qmtp.load(ORACLE, dtype="float32")
    pallas = dataclasses.replace(ref, impl="pallas")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 250, n).tolist() for n in (5, 19)]
    assert_close(qmtp.target_logits(pallas, prompts[1]), qmtp.target_logits(ref, prompts[1]), F32_MODEL, "logits")
    want = qmtp.generate(ref, prompts, max_new_tokens=6, stop_token_ids=[], mtp_k=2)
    got = qmtp.generate(pallas, prompts, max_new_tokens=6, stop_token_ids=[], mtp_k=2)
    assert got.tokens == want.tokens


def test_pallas_impl_on_an_fp8_checkpoint_matches_ref(tmp_path):
    from qmtp.tools import make_checkpoint
    path = make_checkpoint.write_checkpoint(str(tmp_path / "fp8"), "tiny", "fp8", seed=2)
    ref = qmtp.load(path, dtype="float32")
    pallas = dataclasses.replace(ref, impl="pallas")
    ids = list(range(3, 24))
    assert_close(qmtp.target_logits(pallas, ids), qmtp.target_logits(ref, ids), F32_MODEL, "fp8 logits")
    want = qmtp.generate(ref, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=1)
    assert qmtp.generate(pallas, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=1).tokens == want.tokens
