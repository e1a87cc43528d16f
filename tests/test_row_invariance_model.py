"""Where a row's numbers depend on the rows beside it: every layer's mixer and MLP output, the final
hidden state and the logits, compared bit for bit from one random state (paged KV, conv and GDN slot
rings), for a token decoded
  - alone against the same sequence inside a batch of four (each sequence), and
  - in a decode step against the same token as row t of a verify pass of VERIFY tokens;
and the prefill of a prompt alone against the same prompt inside a batch of four (its first token,
first draft, MTP hidden, GDN and conv state, and its attention and MTP KV).

Under KernelConfig.deterministic every one must be equal; the first that is not names the layer and the
block (mixer or MLP), or the part of the prefill, to look into; inside the first GDN mixer, each of its
pieces is compared between a step and a verify. The control: the default Pallas kernels part a verify's
rows and a batch's prefill on the CPU. The H200 cases run the 27B-shaped FP8 preset's first 8 layers
(6 Gated DeltaNet, 2 attention). On the CPU a structural check stands in for the GPU's finding that the
GDN output norm must round in its kernel.
"""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import qmtp
from qmtp.api import _new_state, _prompt_batch
from qmtp.model import layers, target
from qmtp.runtime import loop, ops, prefill
from qmtp.runtime.state import PagedKV, init_state
from qmtp.tools.make_checkpoint import resolve_checkpoint

LENGTHS = (40, 57, 33, 100)  # tokens already in each sequence's cache
PAGE = 16
VERIFY = 4  # tokens of the verify pass (K = 3)


def _random_state(cfg, rng):
    """Four sequences at LENGTHS with random KV pages, conv and GDN state in a ring of VERIFY + 1 slots."""
    pmax = -(-(max(LENGTHS) + VERIFY) // PAGE)
    table = np.arange(len(LENGTHS) * pmax).reshape(len(LENGTHS), pmax) + 1  # page 0 left unused
    state = init_state(cfg, table, table.size + 1, PAGE, jnp.bfloat16, gdn_slots=VERIFY + 1)
    fill = lambda a, scale=1.0: jnp.asarray(rng.standard_normal(a.shape) * scale, a.dtype)  # noqa: E731
    return dataclasses.replace(state, kv=PagedKV(tuple(map(fill, state.kv.k)), tuple(map(fill, state.kv.v))),
                               conv=tuple(map(fill, state.conv)), ssm=tuple(fill(a, 0.1) for a in state.ssm),
                               lengths=jnp.asarray(LENGTHS, jnp.int32))


def _rows(state, b: int):
    """Sequence b alone (the slot rings keep their leading slot axis)."""
    one = lambda a: a[:, b:b + 1]  # noqa: E731
    return dataclasses.replace(state, conv=tuple(map(one, state.conv)), ssm=tuple(map(one, state.ssm)),
                               page_table=state.page_table[b:b + 1], lengths=state.lengths[b:b + 1])


def _differ(a: dict, row_a, b: dict, row_b, label: str) -> list[str]:
    """'name (label)' of each tap (layer order) whose a[name][row_a] and b[name][row_b] differ."""
    order = sorted(a, key=lambda n: (0, int(n.split()[1]), n) if n.startswith("layer") else (1, 0, n))
    return [f"{name} ({label})" for name in order
            if not np.array_equal(np.asarray(a[name][row_a], np.float32), np.asarray(b[name][row_b], np.float32))]


def _parted(checkpoint: str, deterministic: bool) -> list[str]:
    """Every tap that differs, in the batch comparison and in the verify comparison (module doc)."""
    model = qmtp.load(checkpoint, dtype="bfloat16", impl="pallas", page_size=PAGE, progress=False,
                      deterministic=deterministic)
    rng = np.random.default_rng(0)
    state = _random_state(model.cfg, rng)
    tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (len(LENGTHS), VERIFY)), jnp.int32)

    @jax.jit
    def step(params, state, tokens, slots):  # params as an argument: not folded into the program
        taps = {}
        hidden, new = target.forward(model.cfg, params, state, tokens, jnp.full(tokens.shape[:1], tokens.shape[1]),
                                     model.kernels, gdn_slots=slots, taps=taps)
        taps["final hidden"], taps["logits"] = hidden, target.logits_from_hidden(params, hidden, model.kernels)
        return taps, new

    read = jnp.zeros((len(LENGTHS),), jnp.int32)
    batch, _ = jax.device_get(step(model.params, state, tokens[:, :1], read))
    parted = []
    for b in range(len(LENGTHS)):
        alone, _ = jax.device_get(step(model.params, _rows(state, b), tokens[b:b + 1, :1], read[:1]))
        parted += _differ(alone, (0, 0), batch, (b, 0), f"sequence {b} alone vs in the batch")
    verify, _ = jax.device_get(step(model.params, state, tokens, read))
    one = state
    for t in range(VERIFY):  # the same tokens one decode step at a time, the state carried
        taps, one = step(model.params, one, tokens[:, t:t + 1], read + t)
        taps = jax.device_get(taps)
        parted += [d for b in range(len(LENGTHS))
                   for d in _differ(taps, (b, 0), verify, (b, t), f"sequence {b}, token {t}: step vs verify")]
    return parted


def _mixer_parted(checkpoint: str) -> list[str]:
    """Which piece of the first GDN layer's mixer differs between a decode step of the four sequences
    (4 rows) and row 0 of each one's VERIFY-token verify (4 x VERIFY rows), under deterministic: the
    input norm, the joined in_proj_qkv + in_proj_z launch, in_proj_ba, the conv + recurrence kernel,
    the gated norm and out_proj, each fed the same inputs as the model feeds it."""
    model = qmtp.load(checkpoint, dtype="bfloat16", impl="pallas", page_size=PAGE, progress=False,
                      deterministic=True)
    cfg, kernels = model.cfg, model.kernels
    rng = np.random.default_rng(0)
    state = _random_state(cfg, rng)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (len(LENGTHS), VERIFY)), jnp.int32)

    @jax.jit
    def pieces(params, conv, ssm, tokens):
        p, (b, t), eps = params["gdn"][0], tokens.shape, cfg.rms_norm_eps
        out = {"input norm": layers.rms_norm(params["embed"][tokens], p["input_norm"], eps, kernels)}
        out["in_proj_qkv"], z = ops.linear_many(out["input norm"], (p["in_proj_qkv"], p["in_proj_z"]), kernels)
        out["in_proj_ba"] = ops.linear(out["input norm"], p["in_proj_ba"], kernels)
        out["conv + recurrence"], _, _ = ops.gdn_conv_recurrence(
            out["in_proj_qkv"], conv, p["conv"], out["in_proj_ba"], p["A_log"], p["dt_bias"], ssm,
            jnp.full((b,), t, jnp.int32), kernels, slots=jnp.zeros((b,), jnp.int32))
        out["gated norm"] = layers.gated_rms_norm(out["conv + recurrence"], z.reshape(out["conv + recurrence"].shape),
                                                  p["gdn_norm"], eps, kernels, out_dtype=z.dtype).reshape(b, t, -1)
        out["out_proj"] = layers.row_parallel(out["gated norm"], p["out_proj"], kernels)
        return out

    step, verify = (jax.device_get(pieces(model.params, state.conv[0], state.ssm[0], tokens[:, :n]))
                    for n in (1, VERIFY))
    return [name for name in step if not np.array_equal(np.asarray(step[name][:, 0], np.float32),
                                                        np.asarray(verify[name][:, 0], np.float32))]


def _prefill_parted(checkpoint: str, deterministic: bool, chunk: int) -> list[str]:
    """What of prompt 0's prefill differs between the prompt alone and inside a batch of four."""
    model = qmtp.load(checkpoint, dtype="bfloat16", impl="pallas", page_size=PAGE, progress=False,
                      deterministic=deterministic, prefill_chunk=chunk)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (12, 16, 9, 14)]  # one bucket

    def run(group):
        state = _new_state(model, [len(p) + 8 for p in group])
        tokens, n_valid = _prompt_batch(group)
        b = len(group)
        first, slots, state = prefill.prefill(model.cfg, model.kernels, True, model.params, state, tokens, n_valid,
                                              jnp.full((b,), 8, jnp.int32), loop.stop_rows((), b))
        n = len(group[0])  # prompt 0's cached positions, gathered through its page-table row
        where = state.page_table[0, jnp.arange(n) // PAGE] * PAGE + jnp.arange(n) % PAGE
        kv = lambda pages: [p.reshape((-1,) + p.shape[2:])[where] for p in pages]  # noqa: E731
        return jax.device_get({"first token": first[0], "first draft": slots.d1[0], "MTP hidden": slots.mh[0],
                               "GDN state": [s[0] for s in state.ssm], "conv state": [c[0] for c in state.conv],
                               "attention KV": kv(state.kv.k) + kv(state.kv.v),
                               "MTP KV": kv(state.mtp_kv.k) + kv(state.mtp_kv.v)})

    batch, alone = run(prompts), run(prompts[:1])
    return [name for name in alone if not all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                                              for a, b in zip(jax.tree_util.tree_leaves(alone[name]),
                                                              jax.tree_util.tree_leaves(batch[name])))]


def _pallas_calls(jaxpr, name: str):
    """Every pallas_call named `name` in a closed jaxpr, nested jits included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call" and name in str(eqn.params.get("name", "")):
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _pallas_calls(sub, name)
    return found


def test_the_gdn_output_norm_rounds_to_bfloat16_in_its_kernel():
    """Nothing of XLA's between the GDN output norm and out_proj: its kernel writes bfloat16 (on the H100
    a convert left to XLA made a decode step's out_proj part from the same token's in a verify)."""
    model = qmtp.load(resolve_checkpoint("preset:tiny", num_layers=2), dtype="bfloat16", impl="pallas",
                      page_size=PAGE, progress=False, deterministic=True)
    state = _random_state(model.cfg, np.random.default_rng(0))
    tokens = jnp.zeros((len(LENGTHS), 1), jnp.int32)
    closed = jax.make_jaxpr(lambda params, state: target.forward(
        model.cfg, params, state, tokens, jnp.ones((len(LENGTHS),), jnp.int32), model.kernels,
        gdn_slots=jnp.zeros((len(LENGTHS),), jnp.int32)))(model.params, state)
    gated = [e for e in _pallas_calls(closed.jaxpr, "rms_norm_rows") if len(e.invars) == 3]  # x, w, z
    assert gated and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in gated)


@pytest.mark.slow  # CI time: test_deterministic.py checks the tokens of prompts alone and in a batch
def test_a_prompt_prefilled_alone_equals_it_in_a_batch():
    assert _prefill_parted(resolve_checkpoint("preset:tiny", num_layers=2), deterministic=True, chunk=16) == []


@pytest.mark.slow  # CI time: test_deterministic.py checks the tokens alone and in a batch; the GPU check runs it
def test_each_layer_of_a_row_alone_equals_it_in_a_batch():
    assert _parted(resolve_checkpoint("preset:tiny", num_layers=2), deterministic=True) == []


@pytest.mark.slow
def test_the_default_kernels_part_a_row_from_its_rows():
    """The control: without deterministic some tap and some of the prefill differ, so the comparisons
    above can see a difference."""
    tiny = resolve_checkpoint("preset:tiny", num_layers=2)
    assert _parted(tiny, deterministic=False) != [] and _prefill_parted(tiny, deterministic=False, chunk=16) != []


@pytest.mark.gpu
def test_h200_a_prompt_prefilled_alone_equals_it_in_a_batch_at_the_27b_shapes():
    """The default prefill chunk (2048), as the exactness harness runs it."""
    assert _prefill_parted(resolve_checkpoint("preset:qwen3_5_27b:fp8", num_layers=8), deterministic=True,
                           chunk=2048) == []


@pytest.mark.gpu
def test_h200_each_layer_of_a_row_alone_equals_it_in_a_batch_at_the_27b_shapes():
    parted = _parted(resolve_checkpoint("preset:qwen3_5_27b:fp8", num_layers=8), deterministic=True)
    assert parted == [], "\n".join(parted[:24])


@pytest.mark.gpu
def test_h200_each_piece_of_a_gdn_mixer_equals_it_in_a_verify_at_the_27b_shapes():
    """Where the first GDN layer's mixer parts a decode step from a verify: the first piece named (on the
    CPU, at the tiny preset's shapes, no piece parts even under the default kernels: GPU only)."""
    assert _mixer_parted(resolve_checkpoint("preset:qwen3_5_27b:fp8", num_layers=2)) == []
