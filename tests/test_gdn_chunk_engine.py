"""ops.GDN_CONV_CHUNK (setting gdn_conv_chunk): the verify pass and the commit's rebuild run the conv
kernel's chunk form (pallas_kernels/gdn_conv_chunk.py), plain decode stays sequential. Greedy MTP
must still give plain greedy's tokens, and the tokens of the sequential form."""

from __future__ import annotations

import jax
import pytest

import qmtp
from pallas_kernels import gdn_conv
from qmtp import ops

PROMPTS = [[3, 14, 15, 92], [65, 35]]


@pytest.mark.slow  # Pallas interpret mode: ~20 s
def test_chunk_form_keeps_greedy_tokens(ckpt, monkeypatch):
    model = qmtp.load(ckpt, dtype="float32", progress=False, impl="pallas")
    plain = qmtp.generate(model, PROMPTS, max_new_tokens=6, mtp_k=0).tokens
    sequential = qmtp.generate(model, PROMPTS, max_new_tokens=6, mtp_k=3).tokens
    chosen = []  # (form, T) of every conv kernel traced with the setting on
    real = gdn_conv._use_chunk
    monkeypatch.setattr(gdn_conv, "_use_chunk", lambda form, t: chosen.append((form, t)) or real(form, t))
    previous = ops.set_kernel_settings({"gdn_conv_chunk": True})
    jax.clear_caches()  # the setting is read while tracing
    try:
        chunk = qmtp.generate(model, PROMPTS, max_new_tokens=6, mtp_k=3).tokens
    finally:
        ops.set_kernel_settings(previous)
        jax.clear_caches()
    assert ("auto", 4) in chosen, chosen  # the verify pass (and the rebuild) over K+1 = 4 tokens
    assert chunk == sequential == plain
