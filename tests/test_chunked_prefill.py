"""KernelConfig.prefill_chunk: a prompt longer than the chunk is prefilled in chunks, each after the KV
pages and GDN/conv state the one before left; it must give what one pass gives (float32 tolerance)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import qmtp
from qmtp.api import _new_state, _prompt_batch
from qmtp.runtime import loop, prefill
from qmtp.runtime.kernel_config import KernelConfig
from qmtp.tools.make_checkpoint import resolve_checkpoint
from tolerance import F32_RECURRENCE, assert_close

LENGTHS = (50, 37, 3)  # one bucket of 64: rows end inside the last chunk, mid-way, and in the first


def _prefill(model, prompts):
    state = _new_state(model, [len(p) + 8 for p in prompts])
    tokens, n_valid = _prompt_batch(prompts)
    b = len(prompts)
    return prefill.prefill(model.cfg, model.kernels, True, model.params, state, tokens, n_valid,
                        jnp.full((b,), 8, jnp.int32), loop.stop_rows((), b))


@pytest.fixture(scope="module")
def tiny():
    return resolve_checkpoint("preset:tiny")


# chunk boundaries on page edges (8), inside pages (24), a chunk of two pages (32 over 16), and prompts
# that end before the bucket's last chunk (33 of 64 tokens: that chunk is padding for every row, skipped)
@pytest.mark.parametrize("chunk,page_size,lengths", [(16, 8, LENGTHS), (16, 24, LENGTHS), (32, 16, LENGTHS),
                                                     (16, 8, (33, 20, 3))])
def test_chunked_prefill_state_equals_one_pass(tiny, chunk, page_size, lengths):
    one = qmtp.load(tiny, dtype="float32", page_size=page_size, progress=False)
    chunked = dataclasses.replace(one, kernels=dataclasses.replace(one.kernels, prefill_chunk=chunk))
    rng = np.random.default_rng(chunk + page_size)
    prompts = [rng.integers(0, one.cfg.vocab_size, n).tolist() for n in lengths]
    (first_a, slots_a, state_a), (first_b, slots_b, state_b) = _prefill(one, prompts), _prefill(chunked, prompts)
    np.testing.assert_array_equal(np.asarray(first_a), np.asarray(first_b))
    np.testing.assert_array_equal(np.asarray(slots_a.d1), np.asarray(slots_b.d1))
    np.testing.assert_array_equal(np.asarray(state_a.lengths), np.asarray(state_b.lengths))
    assert_close(slots_b.mh, slots_a.mh, F32_RECURRENCE, "MTP hidden of the last token")
    parts = ("ssm", "conv", "kv.k", "kv.v", "mtp_kv.k", "mtp_kv.v")
    for name, a, b in zip(parts, _parts(state_a), _parts(state_b)):
        for j, (x, y) in enumerate(zip(a, b)):
            assert_close(y, x, F32_RECURRENCE, f"{name}[{j}]")


def _parts(state):
    return state.ssm, state.conv, state.kv.k, state.kv.v, state.mtp_kv.k, state.mtp_kv.v


def test_chunked_prefill_keeps_greedy_and_mtp_tokens(tiny):
    one = qmtp.load(tiny, dtype="float32", page_size=8, progress=False)
    chunked = dataclasses.replace(one, kernels=dataclasses.replace(one.kernels, prefill_chunk=16))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, one.cfg.vocab_size, n).tolist() for n in LENGTHS]
    # MTP (K=2): the target's chunks and the MTP layer's; greedy MTP tokens are the target's own
    want = qmtp.generate(one, prompts, max_new_tokens=10, stop_token_ids=[], mtp_k=2).tokens
    assert qmtp.generate(chunked, prompts, max_new_tokens=10, stop_token_ids=[], mtp_k=2).tokens == want


@pytest.mark.parametrize("chunk", [0, 8, 48])
def test_prefill_chunk_must_be_a_power_of_two_of_16_or_more(chunk):
    with pytest.raises(ValueError, match=f"prefill_chunk={chunk}: a power of two >= 16"):
        KernelConfig(prefill_chunk=chunk)


def test_prefill_weights_dequantize_once_what_linear_would_dequantize_per_pass():
    """ops.prefill_weights: at DEQUANT_DOT_MIN_ROWS rows and more (Pallas, not deterministic) each 2-D FP8
    projection becomes the bf16 weight that linear's dequantize-and-dot makes per call, so linear gives the
    same bits from it; fewer rows, the deterministic kernels and expert stacks keep FP8."""
    import jax

    from qmtp.model.fp8 import Fp8Block, quantize_np
    from qmtp.runtime import ops
    rng = np.random.default_rng(0)
    w = Fp8Block(*map(jnp.asarray, quantize_np(rng.standard_normal((256, 384)).astype(np.float32) * 0.05)))
    experts = Fp8Block(jnp.stack([w.weight] * 2), jnp.stack([w.scale] * 2))
    layer = {"proj": w, "experts": experts, "norm": jnp.ones(384, jnp.bfloat16)}
    rows, pallas = ops.DEQUANT_DOT_MIN_ROWS, KernelConfig("pallas")
    got = ops.prefill_weights(layer, rows, jnp.bfloat16, pallas)
    assert got["proj"].dtype == jnp.bfloat16 and got["experts"] is experts and got["norm"] is layer["norm"]
    for kept in (ops.prefill_weights(layer, rows - 1, jnp.bfloat16, pallas),
                 ops.prefill_weights(layer, rows, jnp.bfloat16, KernelConfig("pallas", deterministic=True)),
                 ops.prefill_weights(layer, rows, jnp.bfloat16, KernelConfig("ref"))):
        assert kept is layer
    x = jnp.asarray(rng.standard_normal((rows, 384)), jnp.bfloat16)
    linear = jax.jit(lambda x, w: ops.linear(x, w, pallas, out_dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(linear(x, got["proj"])), np.asarray(linear(x, w)))


def _prefill_temp_bytes(num_layers: int, t: int) -> tuple[int, int]:
    """XLA's temporary bytes of the layer-by-layer prefill program (bf16, MTP on) of a `num_layers` slice of
    the tiny preset over one t-token prompt in chunks of t / 8, and the model's hidden size."""
    model = qmtp.load(resolve_checkpoint("preset:tiny", num_layers), dtype="bfloat16", progress=False,
                      prefill_chunk=t // 8)
    state = _new_state(model, [t])
    lowered = prefill.prefill.lower(model.cfg, model.kernels, True, model.params, state, jnp.zeros((1, t), jnp.int32),
                                    jnp.array([t - 8], jnp.int32), jnp.array([4], jnp.int32), loop.stop_rows((), 1))
    return lowered.compile().memory_analysis().temp_size_in_bytes, model.cfg.hidden_size


def test_layer_by_layer_prefill_memory_does_not_grow_with_the_layers():
    """Each layer's output overwrites its input in one [T, E] buffer: 4 more layers add less than one
    [T, E] (a scan's stacked outputs kept one alive per layer: +1 [T, E] per layer, on the CPU as on
    the GPU, ~20 GB at 64 layers x 32k tokens)."""
    t = 2048
    (deep, hidden), (shallow, _) = _prefill_temp_bytes(8, t), _prefill_temp_bytes(4, t)
    assert deep - shallow < t * hidden * 2  # one [T, E] bf16
