"""The model with impl="pallas" (kernels in interpret mode on the CPU) against impl="ref"."""

import dataclasses
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import qmtp
from qmtp.runtime import ops
from qmtp.runtime.kernel_config import PALLAS, REF
from test_kernel_gdn import make_inputs
from tolerance import F32_MODEL, assert_close

ORACLE = os.path.join(os.path.dirname(__file__), "fixtures", "oracle", "qwen3_5")


@pytest.mark.slow  # ~15 s; the FP8 test below runs the same Pallas model path (logits and MTP tokens) in CI
def test_pallas_impl_matches_ref_logits_and_mtp_tokens():
    ref = qmtp.load(ORACLE, dtype="float32")
    pallas = dataclasses.replace(ref, kernels=PALLAS)
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
    pallas = dataclasses.replace(ref, kernels=PALLAS)
    ids = list(range(3, 24))
    assert_close(qmtp.target_logits(pallas, ids), qmtp.target_logits(ref, ids), F32_MODEL, "fp8 logits")
    want = qmtp.generate(ref, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=1)
    assert qmtp.generate(pallas, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=1).tokens == want.tokens


def test_the_prefill_gdn_chain_is_the_kernel_under_pallas_only():
    """ops.gdn_chunked: the chain over chunks is the Pallas kernel under impl="pallas" (the FP8 test above
    runs it inside the model: its 21-token prompt takes the chunked path) and XLA's scan under "ref"."""
    args = [jnp.asarray(a) for a in make_inputs(1, 40, 1, 2, 16, 16)]
    for kernels, want in ((PALLAS, True), (REF, False)):
        text = str(jax.make_jaxpr(lambda *a, kernels=kernels: ops.gdn_chunked(*a, kernels))(*args))
        assert ("gdn_wy_chunk_states" in text) == want, kernels


@pytest.mark.slow  # ~90 s; the kernel's exact cases and lowering run in CI
def test_gemm_prefill_logits_and_mtp_equal_to_plain(tmp_path):
    """bf16 activations through the FP8 GEMM (a 140-token prompt: its launches of more than 128 rows
    leave the decode grid) give logits within bf16's tolerance of the f32 model's, and greedy MTP K=2
    equals plain."""
    from qmtp.tools import make_checkpoint
    from tolerance import BF16_MODEL
    path = make_checkpoint.write_checkpoint(str(tmp_path / "fp8"), "tiny_tp", "fp8", seed=3)
    model = qmtp.load(path, dtype="bfloat16", progress=False, impl="pallas")
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 250, 140)]
    f32 = np.asarray(qmtp.target_logits(qmtp.load(path, dtype="float32", progress=False), ids), np.float32)
    got = np.asarray(qmtp.target_logits(model, ids), np.float32)
    assert_close(got, f32, BF16_MODEL, "the GEMM vs f32")
    plain = qmtp.generate(model, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=0)
    assert qmtp.generate(model, [ids], max_new_tokens=5, stop_token_ids=[], mtp_k=2).tokens == plain.tokens
