"""Tests of the controlled-acceptance presets (qmtp.tools.presets.ControlledWeights).

tiny_controlled (fp32 / bf16 / fp8): the target's greedy next token after x is pi[x] in any context,
with a wide logit margin, and an independent float64 numpy MTP step (MODEL_SPEC §4.1, decoder layer
included) on the qmtp target hiddens drafts pi[x_{p+1}], recursively pi[draft]; swapped concat halves
or the unshifted token make it draft wrong everywhere. The engine's MTP (qmtp.api.mtp_logits, MTP
generate) is checked too when present. qwen3_5_27b_controlled: config, tensor table and the pinned
tensors of a 2-layer slice from the generator (its forward is marked slow: pytest -m slow).

Margins measured are printed (pytest -s) as "margin[...]" lines.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy before safetensors)
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import numpy_ref as nr
import qmtp
from qmtp import api
from qmtp.model import params, target as model_lib
from qmtp.model.config import from_dict, ModelConfig
from qmtp.runtime.state import init_state
from qmtp.tools import make_checkpoint as mc, presets, tiny_tokenizer

SEED = 0
LIVE = tiny_tokenizer.TINY_VOCAB_SIZE  # 384
SPECIALS = sorted(tiny_tokenizer.special_token_ids(LIVE).values())  # 381, 382, 383
KINDS = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16"}  # checkpoint dtype -> load dtype
MIN_TARGET_MARGIN = 12.0  # logit units (LOGIT_SCALE 32); measured ~21 on tiny
MIN_MTP_MARGIN = 12.0
P = "model.language_model."


def margin(logits: np.ndarray) -> np.ndarray:
    """[..., V] -> top1 - top2 per row."""
    s = np.sort(np.asarray(logits, np.float64), axis=-1)
    return s[..., -1] - s[..., -2]


def report(what: str, m: np.ndarray) -> None:
    print(f"margin[{what}]: min {np.min(m):.2f} mean {np.mean(m):.2f}")


def follow(pi: np.ndarray, start: int, n: int) -> list[int]:
    """[start, pi[start], pi[pi[start]], ...] (n tokens): what greedy generation produces."""
    out = [int(start)]
    for _ in range(n - 1):
        out.append(int(pi[out[-1]]))
    return out


N_PROMPT = 128  # target_logits prompts (one compiled bucket); GDN runs chunked (T >= 16)
N_MTP = 48  # sequences of the MTP checks (one compiled length)


def prompts(pi: np.ndarray) -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    every = rng.permutation(LIVE).tolist()  # every live id once, over three prompts
    return {
        **{f"all_ids_{i}": every[i * N_PROMPT:(i + 1) * N_PROMPT] for i in range(LIVE // N_PROMPT)},
        "random_repeats": rng.integers(0, LIVE, N_PROMPT).tolist(),  # repeats, specials included
        "follows_pi": follow(pi, 5, N_PROMPT),  # natural greedy continuation
    }


@pytest.fixture(scope="module")
def pi() -> np.ndarray:
    return presets.controlled_permutation("tiny_controlled", SEED)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("controlled")
    return {k: mc.write_checkpoint(str(root / k), "tiny_controlled", k, seed=SEED) for k in KINDS}


@pytest.fixture(scope="module")
def models(ckpts) -> dict[str, api.Model]:
    return {k: qmtp.load(ckpts[k], dtype=KINDS[k], progress=False) for k in KINDS}


# --------------------------------------------------------------------------------------------------
# numpy side: checkpoint tensors and one MTP step written from MODEL_SPEC §4.1 / §3
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def np_weights(ckpt: str) -> dict[str, np.ndarray]:
    """Every tensor of a (single-file) checkpoint as float64; FP8 weights dequantized."""
    raw = {}
    with safe_open(os.path.join(ckpt, "model.safetensors"), framework="np") as f:
        for k in f.keys():
            raw[k] = f.get_tensor(k)
    out = {}
    for k, v in raw.items():
        if k.endswith("_scale_inv"):
            continue
        scale = raw.get(k + "_scale_inv")
        out[k] = nr.fp8_dequant(v, np.asarray(scale, np.float64)) if scale is not None else v.astype(np.float64)
    return out


def silu(x):
    return x / (1.0 + np.exp(-x))


def np_mtp(w: dict, cfg: ModelConfig, tokens, hidden, *, swap: bool = False, layer: bool = True):
    """MTP over draft positions 0..T-1 (causal, own KV from position 0). tokens [T] (x_{p+1}),
    hidden [T, E] (h_p). Returns (MTP hidden after mtp.norm [T, E], logits [T, V]), float64."""
    eps = cfg.rms_norm_eps
    e = nr.rms_norm(w[P + "embed_tokens.weight"][np.asarray(tokens)], w["mtp.pre_fc_norm_embedding.weight"], eps)
    hh = nr.rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    u = np.concatenate([hh, e] if swap else [e, hh], axis=-1) @ w["mtp.fc.weight"].T
    if layer:
        m = "mtp.layers.0."
        t, d = len(tokens), cfg.head_dim
        x = nr.rms_norm(u, w[m + "input_layernorm.weight"], eps)
        qg = (x @ w[m + "self_attn.q_proj.weight"].T).reshape(t, cfg.num_attention_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, -1)
        k = (x @ w[m + "self_attn.k_proj.weight"].T).reshape(t, cfg.num_key_value_heads, d)
        v = (x @ w[m + "self_attn.v_proj.weight"].T).reshape(t, cfg.num_key_value_heads, d)
        q = nr.rms_norm(q, w[m + "self_attn.q_norm.weight"], eps)
        k = nr.rms_norm(k, w[m + "self_attn.k_norm.weight"], eps)
        q = np.stack([nr.rope(q[i], i, cfg.rotary_dim, cfg.rope_theta) for i in range(t)])
        k = np.stack([nr.rope(k[i], i, cfg.rotary_dim, cfg.rope_theta) for i in range(t)])
        o = nr.attention(q, k, v, np.arange(t), d ** -0.5).reshape(t, -1) / (1.0 + np.exp(-gate))
        h = u + o @ w[m + "self_attn.o_proj.weight"].T
        y = nr.rms_norm(h, w[m + "post_attention_layernorm.weight"], eps)
        mlp = (silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T))
        u = h + mlp @ w[m + "mlp.down_proj.weight"].T
    hm = nr.rms_norm(u, w["mtp.norm.weight"], eps)
    return hm, hm @ w["lm_head.weight"].T


def np_draft(w, cfg, tokens, hidden, k: int, **kw) -> tuple[list[int], list[float]]:
    """Lag-1 MTP prefill over tokens/hidden, then K-1 recursive steps (token = previous draft,
    hidden = previous MTP output, next position). Returns the K drafts and their margins."""
    tokens, hidden = list(tokens), np.asarray(hidden, np.float64)
    drafts, margins = [], []
    for _ in range(k):
        hm, logits = np_mtp(w, cfg, tokens, hidden, **kw)
        drafts.append(int(np.argmax(logits[-1])))
        margins.append(float(margin(logits[-1])))
        tokens.append(drafts[-1])
        hidden = np.concatenate([hidden, hm[-1:]], axis=0)
    return drafts, margins


_forward = jax.jit(model_lib.forward, static_argnames=("cfg", "kernels"))


def target_hidden(m: api.Model, ids: list[int]) -> np.ndarray:
    """qmtp's post-final-norm target hidden [T, E] (float64) over one sequence."""
    n, page = len(ids), m.page_size
    pages = -(-n // page)
    state = init_state(m.cfg, np.arange(pages, dtype=np.int32)[None], pages, page, api.DTYPES[m.dtype])
    hidden, _ = _forward(m.cfg, m.params, state, jnp.asarray([ids], jnp.int32), jnp.asarray([n], jnp.int32),
                         m.kernels)
    return np.asarray(hidden[0], np.float64)


# --------------------------------------------------------------------------------------------------
# the permutation and its export
# --------------------------------------------------------------------------------------------------


def test_permutation_is_seeded_fixed_point_free_with_two_cycles(pi):
    assert pi.shape == (LIVE,) and sorted(pi.tolist()) == list(range(LIVE))
    assert not np.any(pi == np.arange(LIVE))
    assert sorted(pi[SPECIALS].tolist()) == SPECIALS  # specials map among themselves...
    regular = follow(pi, 0, LIVE - len(SPECIALS) + 1)  # ...and the regular ids form one cycle
    assert len(set(regular[:-1])) == LIVE - len(SPECIALS) and regular[-1] == 0
    again = presets.controlled_permutation("tiny_controlled", SEED)
    assert np.array_equal(again, pi)
    again[0] = -5  # a copy: the cached permutation is not affected
    assert np.array_equal(presets.controlled_permutation("tiny_controlled", SEED), pi)
    other = presets.controlled_permutation("tiny_controlled", SEED + 1)
    assert not np.array_equal(other, pi) and sorted(other.tolist()) == list(range(LIVE))
    # same live vocab and seed: the 27B preset follows the same permutation
    assert np.array_equal(presets.controlled_permutation("qwen3_5_27b_controlled", SEED), pi)
    with pytest.raises(ValueError, match="not a controlled"):
        presets.controlled_permutation("tiny", SEED)


def test_config_records_the_permutation(ckpts, pi):
    for kind, path in ckpts.items():
        with open(os.path.join(path, "config.json")) as f:
            syn = json.load(f)["qmtp_synthetic"]
        assert syn["preset"] == "tiny_controlled" and syn["seed"] == SEED and syn["dtype"] == kind
        assert syn["controlled"]["permutation"] == pi.tolist() and syn["controlled"]["permutation_seed"] == SEED
        assert "controlled" in syn["note"]
        assert np.array_equal(presets.read_controlled_permutation(path), pi)
    with pytest.raises(ValueError, match="not a controlled"):
        presets.read_controlled_permutation(mc.build_config("tiny", "bf16"))
    assert "controlled" not in mc.build_config("tiny", "bf16")["qmtp_synthetic"]


# --------------------------------------------------------------------------------------------------
# the construction, on the stored tensors
# --------------------------------------------------------------------------------------------------


def static_margins(embed: np.ndarray, lm_head: np.ndarray, final_norm: np.ndarray, pi: np.ndarray) -> np.ndarray:
    """Per live x: margin of the logits of h = final_norm(embed[x]) (all layers switched off), and
    checks their argmax is pi[x]."""
    live = embed[:LIVE].astype(np.float64)
    logits = nr.rms_norm(live, final_norm, 1e-6) @ np.asarray(lm_head, np.float64).T
    assert np.array_equal(np.argmax(logits, -1), pi)
    return margin(logits)


def test_stored_tensors_follow_the_construction(ckpts, pi):
    w = np_weights(ckpts["fp32"])
    cfg = ModelConfig.from_hf(ckpts["fp32"])
    e = cfg.hidden_size
    embed, head = w[P + "embed_tokens.weight"], w["lm_head.weight"]
    assert np.allclose(np.linalg.norm(embed[:LIVE], axis=1), math.sqrt(e), rtol=1e-2)
    scale = presets.ControlledWeights.LOGIT_SCALE / e
    np.testing.assert_allclose(head[pi], scale * embed[:LIVE], rtol=2 ** -8, atol=0)
    fc = w["mtp.fc.weight"]
    noise = presets.ControlledWeights.FC_NOISE / math.sqrt(e)
    assert np.abs(np.diag(fc[:, :e]) - 1).max() < 6 * noise
    for block in (fc[:, :e] - np.eye(e), fc[:, e:]):
        assert 0.8 * noise < block.std() < 1.2 * noise
    out = presets.ControlledWeights.OUTPUT_SCALE
    for name, t in w.items():  # residual-branch outputs scaled down, the rest as the plain preset
        if t.ndim == 2 and name.startswith(("model", "mtp.layers")) and "embed" not in name:
            want = (out if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 1.0)
            assert 0.85 * want < t.std() * math.sqrt(t.shape[1]) < 1.15 * want, name
    m = static_margins(embed, head, w[P + "norm.weight"], pi)
    report("static tiny (every live id, layers off)", m)
    assert m.min() > 15.0


def test_random_tensors_are_shared_with_the_plain_preset(ckpts, tmp_path):
    """Same seed: every tensor the controlled preset does not pin or scale is the tiny preset's."""
    plain = np_weights(mc.write_checkpoint(str(tmp_path / "plain"), "tiny", "fp32", seed=SEED))
    ctl = np_weights(ckpts["fp32"])
    pinned = ("embed_tokens.weight", "lm_head.weight", "mtp.fc.weight", "o_proj.weight", "out_proj.weight",
              "down_proj.weight")
    same = [n for n in plain if not n.endswith(pinned)]
    assert len(same) > 40 and all(np.array_equal(plain[n], ctl[n]) for n in same)
    scaled = [n for n in plain if n.endswith(pinned[3:])]
    out = presets.ControlledWeights.OUTPUT_SCALE
    assert scaled and all(np.allclose(ctl[n], out * plain[n], rtol=2 ** -7, atol=1e-30) for n in scaled)


# --------------------------------------------------------------------------------------------------
# the target through qmtp
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_target_follows_permutation(models, pi, kind):
    worst = []
    for name, ids in prompts(pi).items():
        logits = api.target_logits(models[kind], ids)
        assert np.array_equal(np.argmax(logits, -1), pi[ids]), f"{kind} {name}"
        worst.append(margin(logits).min())
    report(f"target {kind}", np.array(worst))
    assert min(worst) > MIN_TARGET_MARGIN


def test_layers_do_real_work(models, pi):
    """The hidden moves off the embedding direction and depends on the context (not only x_p)."""
    m, ids = models["fp32"], prompts(pi)["random_repeats"][:N_MTP]
    h = target_hidden(m, ids)
    emb = np_weights(m.checkpoint_dir)[P + "embed_tokens.weight"][ids]
    cos = np.sum(h * emb, -1) / np.linalg.norm(h, axis=-1) / np.linalg.norm(emb, axis=-1)
    print(f"cos(target hidden, embedding of the input token): min {cos.min():.3f} max {cos.max():.3f}")
    assert 0.8 < cos.min() and cos.max() < 0.995
    tok = max(set(ids), key=ids.count)  # the same input token in different contexts
    rows = h[[i for i, t in enumerate(ids) if t == tok]]
    assert len(rows) >= 2 and np.abs(rows - rows[0]).max() > 1e-2 * np.abs(rows).max()


# --------------------------------------------------------------------------------------------------
# the MTP head: independent numpy step on qmtp's target hiddens
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_numpy_mtp_drafts_the_permutation_and_catches_wiring_errors(models, pi, kind):
    m = models[kind]
    w, cfg = np_weights(m.checkpoint_dir), m.cfg
    ids = prompts(pi)["random_repeats"][:N_MTP]
    h = target_hidden(m, ids)
    x_next = int(pi[ids[-1]])  # what the target samples after the prompt
    tokens = ids[1:] + [x_next]  # lag-1: position p gets x_{p+1}

    hm, logits = np_mtp(w, cfg, tokens, h)
    assert np.array_equal(np.argmax(logits, -1), pi[tokens])
    report(f"numpy MTP {kind}", margin(logits))
    assert margin(logits).min() > MIN_MTP_MARGIN

    # the decoder layer is part of it: switching it off moves the logits
    _, no_layer = np_mtp(w, cfg, tokens, h, layer=False)
    assert np.abs(no_layer - logits).max() > 0.1

    # recursive drafting (hidden = own post-mtp.norm output, token = previous draft)
    drafts, margins = np_draft(w, cfg, tokens, h, k=4)
    assert drafts == follow(pi, x_next, 5)[1:]
    report(f"numpy MTP recursive K=4 {kind}", np.array(margins))
    assert min(margins) > MIN_MTP_MARGIN

    # wiring errors: every draft wrong
    _, swapped = np_mtp(w, cfg, tokens, h, swap=True)  # [hidden, embedding]: follows h_p ~ emb[x_p]
    assert np.array_equal(np.argmax(swapped, -1), pi[ids])
    assert not np.any(np.argmax(swapped, -1) == pi[tokens])
    _, unshifted = np_mtp(w, cfg, ids, h)  # x_p instead of x_{p+1}
    assert not np.any(np.argmax(unshifted, -1) == pi[tokens])


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_numpy_mtp_acceptance_on_generated_text(models, pi, kind):
    """Greedy text follows pi: correct wiring accepts every draft, swapped concat none."""
    m = models[kind]
    w, cfg = np_weights(m.checkpoint_dir), m.cfg
    seq = follow(pi, 42, N_MTP)
    h = target_hidden(m, seq)
    tokens = seq[1:] + [int(pi[seq[-1]])]
    target_next = pi[tokens]  # the target's argmax at p + 1
    good = np.argmax(np_mtp(w, cfg, tokens, h)[1], -1)
    bad = np.argmax(np_mtp(w, cfg, tokens, h, swap=True)[1], -1)
    print(f"numpy MTP acceptance {kind}: correct {np.mean(good == target_next):.2f}, "
          f"swapped concat {np.mean(bad == target_next):.2f}")
    assert np.mean(good == target_next) == 1.0 and np.mean(bad == target_next) == 0.0
    assert np.array_equal(bad, tokens)  # the swapped head repeats its input token


# --------------------------------------------------------------------------------------------------
# the engine's MTP head (qmtp.api.mtp_logits / generate(mtp_k=...))
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_mtp_logits(models, pi, kind):
    m = models[kind]
    ids = prompts(pi)["all_ids_0"][:N_MTP]
    r = api.mtp_logits(m, ids)
    assert np.array_equal(r.draft_argmax, pi[ids[1:]]) and r.agreement == 1.0
    report(f"engine MTP {kind}", margin(r.logits))
    assert margin(r.logits).min() > MIN_MTP_MARGIN
    # and it agrees with the numpy step on the same target hiddens
    h = target_hidden(m, ids)
    _, ref = np_mtp(np_weights(m.checkpoint_dir), m.cfg, ids[1:], h[:-1])
    tol = 1e-3 if kind == "fp32" else 0.5
    assert np.abs(np.asarray(r.logits, np.float64) - ref).max() < tol


def test_engine_mtp_with_swapped_fc_halves_is_always_wrong(ckpts, pi, tmp_path):
    bad = str(tmp_path / "swapped")
    shutil.copytree(ckpts["fp32"], bad)
    path = os.path.join(bad, "model.safetensors")
    with safe_open(path, framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    e = tensors["mtp.fc.weight"].shape[0]
    tensors["mtp.fc.weight"] = np.ascontiguousarray(np.concatenate(
        [tensors["mtp.fc.weight"][:, e:], tensors["mtp.fc.weight"][:, :e]], axis=1))
    save_file(tensors, path, metadata={"format": "pt"})
    seq = follow(pi, 42, N_MTP)
    r = api.mtp_logits(qmtp.load(bad, dtype="float32", progress=False), seq)
    print(f"engine MTP acceptance with swapped fc halves: {r.agreement:.2f}")
    assert r.agreement == 0.0 and np.array_equal(r.draft_argmax, seq[1:])


@pytest.mark.slow  # CI time: test_engine's controlled-checkpoint test stays in CI
@pytest.mark.parametrize("kind", ["bf16"])
def test_engine_speculative_generation_accepts_everything(models, pi, kind):
    prompt = follow(pi, 9, 20)
    res = api.generate(models[kind], [prompt], max_new_tokens=24, mtp_k=3)
    assert res.tokens[0] == follow(pi, prompt[-1], 25)[1:]
    stats = res.stats
    print(f"engine MTP generate {kind}: {({k: stats.get(k) for k in ('acceptance_rate', 'position_acceptance')})}")
    if "acceptance_rate" in stats:
        assert stats["acceptance_rate"] == 1.0


# --------------------------------------------------------------------------------------------------
# qwen3_5_27b_controlled (2-layer slice): config, tensor table, the pinned tensors
# --------------------------------------------------------------------------------------------------


def test_27b_controlled_slice_config_and_tensors():
    config = mc.build_config("qwen3_5_27b_controlled", "fp8", seed=SEED, num_layers=2)
    plain = mc.build_config("qwen3_5_27b", "fp8", seed=SEED, num_layers=2)
    assert config["text_config"] == plain["text_config"]
    assert config["quantization_config"] == plain["quantization_config"]
    pi = presets.controlled_permutation("qwen3_5_27b_controlled", SEED)
    assert np.array_equal(presets.read_controlled_permutation(config), pi)
    assert "ids >= 384 are vocabulary padding" in config["qmtp_synthetic"]["note"]

    cfg = from_dict(config)
    assert cfg.layer_types == ("linear_attention", "full_attention") and cfg.hidden_size == 5120
    assert mc.plan_tensors(cfg, "fp8") == mc.plan_tensors(from_dict(plain), "fp8")
    table = {t.name: t for t in params.tensor_table(cfg)}
    gen = presets.get_preset("qwen3_5_27b_controlled").weights(cfg, SEED)
    e, v = 5120, 248320

    embed = gen(table[P + "embed_tokens.weight"], False)
    head = gen(table["lm_head.weight"], False)
    assert isinstance(embed, presets.PinnedRows) and isinstance(head, presets.PinnedRows)
    assert embed.shape == head.shape == (v, e) and head.zero_from == LIVE and embed.zero_from == v
    emb_rows = embed.rows(0, 512).astype(np.float64)  # live rows pinned, then hashed N(0, 1) rows
    plain_gen = presets.get_preset("qwen3_5_27b").weights(from_dict(plain), SEED)
    plain_rows = plain_gen(table[P + "embed_tokens.weight"], False).rows(LIVE, 512).astype(np.float64)
    assert np.array_equal(emb_rows[LIVE:], plain_rows)
    assert np.allclose(np.linalg.norm(emb_rows[:LIVE], axis=1), math.sqrt(e), rtol=1e-2)
    head_rows = head.rows(0, 512).astype(np.float64)
    assert not head_rows[LIVE:].any()
    scale = presets.ControlledWeights.LOGIT_SCALE / e
    np.testing.assert_allclose(head_rows[pi], scale * emb_rows[:LIVE], rtol=2 ** -8, atol=0)
    m = static_margins(emb_rows, head_rows, np.zeros(e), pi)
    report("static 27B (every live id, layers off)", m)
    assert m.min() > 25.0

    out = presets.ControlledWeights.OUTPUT_SCALE
    for name, t in table.items():
        if t.role == params.LINEAR and name != "mtp.fc.weight":
            value = gen(t, mc.is_fp8_eligible(t))
            assert isinstance(value, presets.HashedNormal) and value.fp8 == mc.is_fp8_eligible(t), name
            want = out if t.key in ("o_proj", "out_proj", "mlp_down") else 1.0
            assert math.isclose(value.std * math.sqrt(t.shape[1]), want, rel_tol=1e-9), name


@pytest.mark.slow  # 27B-shaped forward: ~4 GB disk, ~10 GB RAM, ~1 min (pytest -m slow)
def test_27b_controlled_slice_forward(tmp_path):
    path = mc.write_checkpoint(str(tmp_path / "b27"), "qwen3_5_27b_controlled", "fp8", seed=SEED, num_layers=2)
    pi = presets.read_controlled_permutation(path)
    m = qmtp.load(path, dtype="bfloat16", progress=False)
    ids = np.random.default_rng(3).permutation(LIVE)[:40].tolist()
    logits = api.target_logits(m, ids)
    assert np.array_equal(np.argmax(logits, -1), pi[ids]) and not logits[:, LIVE:].any()
    report("target 27B 2-layer fp8", margin(logits))
    assert margin(logits).min() > MIN_TARGET_MARGIN
    r = api.mtp_logits(m, ids)
    assert r.agreement == 1.0 and np.array_equal(r.draft_argmax, pi[ids[1:]])
    report("engine MTP 27B 2-layer fp8", margin(r.logits))


def test_the_moe_controlled_preset_follows_the_permutation_and_its_mtp_drafts_it():
    """tiny_moe_controlled: the sparse MoE blocks (experts and shared expert scaled like the dense MLP's
    down projection) keep the target on pi, and the MTP head accepts every draft."""
    pi = presets.controlled_permutation("tiny_moe_controlled", SEED)
    model = qmtp.load(mc.resolve_checkpoint("preset:tiny_moe_controlled"), progress=False)
    prompt = [5, 17, 33, 2]
    result = qmtp.generate(model, [prompt], max_new_tokens=12, stop_token_ids=[], mtp_k=3)
    want = [int(pi[prompt[-1]])]
    for _ in range(11):
        want.append(int(pi[want[-1]]))
    assert result.tokens[0] == want and result.stats["accepted"] == 3 * result.stats["rounds"]
