"""qmtp/model/moe.py against a float64 numpy transcription of HF transformers' sparse MoE block (the
router's softmax and top-k, optional renormalisation, the experts' SwiGLU weighted and summed, the shared
expert behind its sigmoid gate), written here from MODEL_SPEC §3.4 with no code shared; the routed form
(grouped rows) against every expert over every token; a token's result independent of its batch."""

import jax.numpy as jnp
import numpy as np
import pytest

from qmtp.model import load, moe
from qmtp.runtime.kernel_config import KernelConfig, REF

PALLAS, DETERMINISTIC = KernelConfig("pallas"), KernelConfig("pallas", deterministic=True)

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


@pytest.mark.parametrize("joined", [False, True], ids=["router_and_gate", "router_gate"])
@pytest.mark.parametrize("norm", [True, False])
def test_sparse_moe_matches_the_reference(norm, joined):
    """The block as the checkpoint holds it, and with the router and shared gate joined as qmtp.load
    joins them (load.fuse_router_gates)."""
    rng = np.random.default_rng(0)
    p = _params(rng)
    x = rng.standard_normal((2, 5, H)).astype(np.float32)  # [B, T, H]
    tree = load.fuse_router_gates(jax_tree(p)) if joined else jax_tree(p)
    assert ("router_gate" in tree) == joined and ("router" in tree) != joined
    got = moe.sparse_moe(tree, jnp.asarray(x), top_k=K, norm_topk_prob=norm, kernels=REF)
    assert got.shape == x.shape
    np.testing.assert_allclose(np.asarray(got).reshape(-1, H), _np_moe(p, x.reshape(-1, H), norm), rtol=1e-5, atol=1e-5)


def test_route_picks_the_k_most_probable_experts_lower_first_on_ties():
    router = np.zeros((E, H), np.float32)
    router[3, 0], router[1, 0] = 2.0, 1.0  # token 0: expert 3, then 1; token 1 (x = 0): all tie -> 0, 1
    x = np.zeros((2, H), np.float32)
    x[0, 0] = 1.0
    w, e = moe.route(jnp.asarray(x @ router.T), K, True, REF)
    np.testing.assert_array_equal(np.asarray(e), [[3, 1], [0, 1]])
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("tokens", [37, moe.COMPARE_MAX_PAIRS // K + 5], ids=["compared", "sorted"])
def test_group_rows_give_each_pair_a_row_of_its_experts_block(tokens):
    rng = np.random.default_rng(2)
    experts = jnp.asarray(np.sort(rng.choice(E, size=(tokens, K), replace=True), axis=-1), jnp.int32)
    row, block_expert, row_pair = map(np.asarray, moe.group_rows(experts, E))
    flat = np.asarray(experts).reshape(-1)
    br = moe.BLOCK_ROWS if flat.size <= moe.COMPARE_MAX_PAIRS else moe.PREFILL_BLOCK_ROWS
    assert row_pair.size == block_expert.size * br
    assert len(set(row.tolist())) == flat.size and row.max() < row_pair.size
    np.testing.assert_array_equal(block_expert[row // br], flat)  # each row in a block of its expert
    rank = np.array([np.sum(flat[:p] == flat[p]) for p in range(flat.size)])  # earlier pairs of its expert
    np.testing.assert_array_equal(row % br, rank % br)  # from a block boundary, in order
    np.testing.assert_array_equal(row_pair[row], np.arange(flat.size))  # the inverse map
    assert (np.delete(row_pair, row) == -1).all()
    used = block_expert >= 0
    assert used[:used.sum()].all()  # the used blocks first, the rest -1


@pytest.mark.parametrize("k, experts", [(K, E), (8, 256), (10, 512), (20, 64)])
def test_one_tokens_rows_are_group_rows(k, experts):
    """A single token's layout from constants equals the general one for its (ascending) experts."""
    rng = np.random.default_rng(k)
    for _ in range(5):
        e = jnp.asarray(np.sort(rng.choice(experts, size=k, replace=False))[None], jnp.int32)
        for got, want in zip(moe.one_token_rows(e, experts), moe.group_rows(e, experts)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_by_expert_index_orders_each_tokens_pairs_as_a_sort():
    rng = np.random.default_rng(5)
    e = np.stack([rng.choice(256, size=8, replace=False) for _ in range(33)]).astype(np.int32)
    w = rng.standard_normal(e.shape).astype(np.float32)
    got_w, got_e = moe.by_expert_index(jnp.asarray(w), jnp.asarray(e))
    order = np.argsort(e, axis=-1)
    np.testing.assert_array_equal(np.asarray(got_e), np.take_along_axis(e, order, -1))
    np.testing.assert_array_equal(np.asarray(got_w), np.take_along_axis(w, order, -1))


@pytest.mark.parametrize("kernels", [REF, PALLAS], ids=["ref", "pallas"])
@pytest.mark.parametrize("tokens", [7, moe.COMPARE_MAX_PAIRS // K + 3], ids=["decode", "prefill"])
def test_routed_form_equals_every_expert_over_every_token(kernels, tokens):
    """Both block heights: a step's (BLOCK_ROWS) and a prefill's (PREFILL_BLOCK_ROWS)."""
    rng = np.random.default_rng(3)
    p = jax_tree(_params(rng))
    x = jnp.asarray(rng.standard_normal((3, tokens, H)), jnp.float32)
    routed = moe.sparse_moe(p, x, top_k=K, norm_topk_prob=True, kernels=kernels)
    full = moe.sparse_moe_ref(p, x, top_k=K, norm_topk_prob=True, kernels=kernels)
    np.testing.assert_allclose(np.asarray(routed), np.asarray(full), rtol=1e-6, atol=1e-6)


def test_a_token_alone_equals_it_among_others_under_deterministic():
    rng = np.random.default_rng(4)
    p = {k: jnp.asarray(v, jnp.bfloat16) for k, v in _params(rng).items()}
    x = jnp.asarray(rng.standard_normal((9, H)), jnp.bfloat16)
    run = lambda v: np.asarray(moe.sparse_moe(p, v, top_k=K, norm_topk_prob=True, kernels=DETERMINISTIC),  # noqa: E731
                               np.float32)
    assert np.array_equal(run(x[:1])[0], run(x)[0])


@pytest.mark.parametrize("experts", [6, 256, 512])
def test_router_probabilities_of_a_token_do_not_depend_on_its_batch(experts):
    """The router's softmax sums over the experts in one fixed order: a token's probabilities are the
    same bits alone and among 2..64 tokens (jitted, as in the model; XLA's own softmax over 256 experts
    changed row 0's bits from 16 rows on this CPU) and agree with jax.nn.softmax to f32 rounding."""
    import jax
    logits = jax.random.normal(jax.random.PRNGKey(experts), (64, experts), jnp.float32) * 3
    softmax = jax.jit(moe.softmax_fixed_order)
    alone = np.asarray(softmax(logits[:1]))[0]
    for rows in (2, 5, 16, 17, 33, 64):
        assert np.array_equal(np.asarray(softmax(logits[:rows]))[0], alone), rows
    np.testing.assert_allclose(np.asarray(softmax(logits)), np.asarray(jax.nn.softmax(logits, axis=-1)),
                               rtol=1e-6, atol=1e-9)

