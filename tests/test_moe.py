"""qmtp/model/moe.py against a float64 numpy transcription of HF transformers' sparse MoE block (the
router's softmax and top-k, optional renormalisation, the experts' SwiGLU weighted and summed, the shared
expert behind its sigmoid gate), written here from MODEL_SPEC §3.4 with no code shared."""

import jax.numpy as jnp
import numpy as np
import pytest

from qmtp.model import moe
from qmtp.runtime.kernel_config import REF

E, K, H, I, I_SHARED = 6, 2, 16, 8, 12


def _params(rng) -> dict:
    n = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.3  # noqa: E731
    return {"router": n(E, H), "experts_gate_up": n(E, 2 * I, H), "experts_down": n(E, H, I),
            "shared_mlp_gate": n(I_SHARED, H), "shared_mlp_up": n(I_SHARED, H), "shared_mlp_down": n(H, I_SHARED),
            "shared_gate": n(1, H)}


def jax_tree(p: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in p.items()}


def _np_moe(p: dict, x: np.ndarray, norm: bool) -> np.ndarray:
    f = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = x.astype(np.float64)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    logits = x @ f["router"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(len(x)):
        top = np.argsort(-probs[t], kind="stable")[:K]
        w = probs[t, top] / (probs[t, top].sum() if norm else 1.0)
        for e, we in zip(top, w):
            g, u = f["experts_gate_up"][e][:I] @ x[t], f["experts_gate_up"][e][I:] @ x[t]
            out[t] += we * (f["experts_down"][e] @ (silu(g) * u))
    shared = (silu(x @ f["shared_mlp_gate"].T) * (x @ f["shared_mlp_up"].T)) @ f["shared_mlp_down"].T
    return out + shared / (1 + np.exp(-(x @ f["shared_gate"].T)))


@pytest.mark.parametrize("norm", [True, False])
def test_sparse_moe_matches_the_reference(norm):
    rng = np.random.default_rng(0)
    p = _params(rng)
    x = rng.standard_normal((2, 5, H)).astype(np.float32)  # [B, T, H]
    got = moe.sparse_moe(jax_tree(p), jnp.asarray(x), top_k=K, norm_topk_prob=norm, kernels=REF)
    assert got.shape == x.shape
    np.testing.assert_allclose(np.asarray(got).reshape(-1, H), _np_moe(p, x.reshape(-1, H), norm), rtol=1e-5, atol=1e-5)


def test_route_picks_the_k_most_probable_experts_lower_first_on_ties():
    router = np.zeros((E, H), np.float32)
    router[3, 0], router[1, 0] = 2.0, 1.0  # token 0: expert 3, then 1; token 1 (x = 0): all tie -> 0, 1
    x = np.zeros((2, H), np.float32)
    x[0, 0] = 1.0
    w, e = moe.route(jnp.asarray(router), jnp.asarray(x), K, True, REF)
    np.testing.assert_array_equal(np.asarray(e), [[3, 1], [0, 1]])
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
