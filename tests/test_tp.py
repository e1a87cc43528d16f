"""Tensor-parallel building blocks on two fake CPU devices: mesh, split checks, vocab-parallel argmax."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from qmtp.model.config import ModelConfig
from qmtp.runtime import tp
from qmtp.tools import make_checkpoint


def _argmax_tp(logits: np.ndarray, n: int) -> np.ndarray:
    mesh = tp.make_mesh(n)
    f = jax.shard_map(tp.vocab_parallel_argmax, mesh=mesh, in_specs=P(None, tp.AXIS), out_specs=P())
    return np.asarray(jax.jit(f)(jnp.asarray(logits)))


@pytest.mark.parametrize("n", [1, 2])
def test_vocab_parallel_argmax_equals_full_argmax(n):
    logits = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    np.testing.assert_array_equal(_argmax_tp(logits, n), logits.argmax(-1))


def test_ties_across_the_shard_boundary_go_to_the_lowest_id():
    logits = np.zeros((4, 8), np.float32)
    logits[0, [3, 4]] = 5.0  # tie across the boundary (shard 0 holds 0..3, shard 1 holds 4..7)
    logits[1, [5, 1]] = 2.0  # tie, lower id in shard 0
    logits[2, [6, 7]] = 1.0  # tie inside shard 1
    logits[3, :] = -1.0  # all equal: id 0
    want = logits.argmax(-1)
    assert want.tolist() == [3, 1, 6, 0]
    np.testing.assert_array_equal(_argmax_tp(logits, 2), want)


def test_vocab_parallel_argmax_is_one_collective():
    """Each collective of a TP2 decode step costs its latency: the argmax takes one, not two."""
    import re
    mesh = tp.make_mesh(2)
    f = jax.jit(jax.shard_map(tp.vocab_parallel_argmax, mesh=mesh, in_specs=P(None, tp.AXIS), out_specs=P()))
    hlo = f.lower(jnp.zeros((3, 64), jnp.bfloat16)).compile().as_text()
    ops = re.findall(r"= \S+ (all-reduce|all-gather|collective-permute|all-to-all)(?:-start)?\(", hlo)
    assert ops == ["all-gather"], ops


def test_mesh_and_split_checks_name_the_limit():
    with pytest.raises(ValueError, match=r"--tp=3: 2 cpu device\(s\) visible"):
        tp.make_mesh(3)
    cfg = ModelConfig.from_hf(make_checkpoint.ensure_preset("tiny", "bf16"))
    tp.check_tp(cfg, 2)  # 4 q heads, 2 kv heads, 2/4 GDN heads, ffn 272, vocab 384
    with pytest.raises(ValueError, match=r"--tp=2: intermediate_size=271 is not divisible by 2"):
        tp.check_tp(dataclasses.replace(cfg, intermediate_size=271), 2)
    tp.check_tp(dataclasses.replace(cfg, num_key_value_heads=1), 2)  # one KV head: replicated
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 can be neither split nor replicated 3 ways"):
        tp.check_tp(dataclasses.replace(cfg, num_attention_heads=6, linear_num_key_heads=3,
                                        linear_num_value_heads=6, intermediate_size=270, vocab_size=384), 3)
    with pytest.raises(ValueError, match=r"FP8 weights need shard boundaries on 128-multiples, but "
                                         r"intermediate_size / tp = 136"):
        tp.check_tp(cfg, 2, fp8=True)
    from qmtp.model.config import from_dict
    real = from_dict(make_checkpoint.build_config("qwen3_5_27b", "fp8", 0, None))
    tp.check_tp(real, 2, fp8=True)  # the 27B splits in two on 128-blocks (ffn 8704 = 68 x 128 per shard)


def test_moe_split_checks_name_the_expert_widths():
    from qmtp.model.config import from_dict
    cfg = ModelConfig.from_hf(make_checkpoint.ensure_preset("tiny_moe", "bf16"))
    tp.check_tp(cfg, 2)  # experts 128 wide, shared expert 96: no dense layer, so no intermediate_size
    with pytest.raises(ValueError, match=r"--tp=2: moe_intermediate_size=127 is not divisible by 2"):
        tp.check_tp(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_size=127)), 2)
    with pytest.raises(ValueError, match=r"--tp=2: shared_expert_intermediate_size=97 is not divisible by 2"):
        tp.check_tp(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_size=97)), 2)
    with pytest.raises(ValueError, match=r"--tp=2: intermediate_size=271 is not divisible by 2"):  # a dense layer
        tp.check_tp(dataclasses.replace(cfg, intermediate_size=271,
                                        moe=dataclasses.replace(cfg.moe, mlp_only_layers=(1,))), 2)
    for preset in ("qwen3_5_35b_a3b", "qwen3_next_80b_a3b"):  # experts 512 wide: 2 x 128 per shard
        tp.check_tp(from_dict(make_checkpoint.build_config(preset, "fp8", 0, None)), 2, fp8=True)
