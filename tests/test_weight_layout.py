"""The FP8 weights in the kernels' tiled layout at load under Pallas (qmtp/model/weight_layout.py):
which weights take it, that their values and TP shards are the checkpoint's, and that a model
with tiled weights gives the same logits, bit for bit, as one without."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import qmtp
from pallas_kernels.fp8_layout import untile_weight
from qmtp.model import weight_layout
from qmtp.model.fp8 import Fp8Block
from qmtp.runtime.kernel_config import PALLAS
from qmtp.tools import make_checkpoint


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    # tiny_tp: E 256, F 512, head dim 128: every FP8 weight splits into whole [128, 128] tiles
    return make_checkpoint.write_checkpoint(str(tmp_path_factory.mktemp("layout") / "fp8"), "tiny_tp", "fp8", seed=1)


def _blocks(params):
    """{path: Fp8Block} of a parameter tree."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, Fp8Block))[0]
    return {jax.tree_util.keystr(p): v for p, v in leaves if isinstance(v, Fp8Block)}


def _load(path, tiled: bool, **kw):
    """The checkpoint under the Pallas kernels: loaded for them (tiled), or loaded for the reference
    path (the checkpoint layout, which every kernel also takes) and then run with them."""
    if tiled:
        return qmtp.load(path, dtype="float32", progress=False, impl="pallas", **kw)
    return dataclasses.replace(qmtp.load(path, dtype="float32", progress=False, **kw), kernels=PALLAS)


def _tileable(block, dim=None, n=1) -> bool:
    """Whether `block` (split n ways along dim) takes tiles on every device: weight_layout.tile_rows."""
    return weight_layout.tile_rows(block, dim, n) is not None


def test_tileable_rules():
    import jax.numpy as jnp
    block = lambda o, i: Fp8Block(jnp.zeros((o, i), jnp.float8_e4m3fn), jnp.ones((-(-o // 128), -(-i // 128))))  # noqa: E731
    assert _tileable(block(256, 384))
    assert not _tileable(block(160, 384)) and not _tileable(block(256, 160))
    assert _tileable(block(256, 256), dim=1, n=2) and not _tileable(block(256, 384), dim=1, n=2)
    assert _tileable(block(256, 384), dim=0, n=2) and not _tileable(block(192, 384), dim=0, n=2)


def test_load_tiles_every_tileable_weight_with_its_values(fp8_dir):
    plain, tiled = _load(fp8_dir, False), _load(fp8_dir, True)
    a, b = _blocks(plain.params), _blocks(tiled.params)
    assert a.keys() == b.keys() and len(a) > 10
    assert not any(x.tiled for x in a.values())
    for key, blk in b.items():
        assert blk.shape == a[key].shape, key  # the logical shape in either layout
        assert blk.tiled == _tileable(a[key]), key
        np.testing.assert_array_equal(np.asarray(untile_weight(blk.weight)).view(np.uint8),
                                      np.asarray(a[key].weight).view(np.uint8), err_msg=key)
        np.testing.assert_array_equal(np.asarray(blk.scale), np.asarray(a[key].scale), err_msg=key)
    assert sum(x.tiled for x in b.values()) == len(b)  # tiny_tp: all of them
    # the same logits, bit for bit (the kernels read the same chunks in the same order)
    np.testing.assert_array_equal(np.asarray(qmtp.target_logits(tiled, [1, 2, 3])),
                                  np.asarray(qmtp.target_logits(plain, [1, 2, 3])))


def test_reference_impl_keeps_the_checkpoint_layout(fp8_dir):
    ref = qmtp.load(fp8_dir, dtype="float32", progress=False, impl="ref")
    assert not any(x.tiled for x in _blocks(ref.params).values())


def test_tp2_tiles_each_shard_in_place(fp8_dir):
    """Under TP2 each device's shard is tiled where it lives: the tiled weight is split on the same
    dimension as the [O, I] one (O for column-parallel, I for row-parallel), and each shard's values
    are its [O, I] shard's. A shard of no whole number of 128-row tiles takes 64-row ones: tiny_tp's
    draft head (384 rows, 192 per device)."""
    from qmtp.model import shard_layout
    plain, tiled = _load(fp8_dir, False, tp=2), _load(fp8_dir, True, tp=2)
    a, b = _blocks(plain.params), _blocks(tiled.params)
    dims, short = set(), []
    for key, blk in b.items():
        assert blk.tiled, key
        dim = shard_layout.split_dim(key.split("'")[-2])
        assert blk.weight.shape[2] == weight_layout.tile_rows(a[key], dim, 2), key
        if blk.weight.shape[2] == 64:
            short.append(key)
        dims.add(dim)
        spec = tuple(blk.weight.sharding.spec) + (None,) * (4 - len(blk.weight.sharding.spec))
        assert spec[:2] == tuple("tp" if d == dim else None for d in range(2)) and spec[2:] == (None, None), (key, spec)
        for sa, sb in zip(a[key].weight.addressable_shards, blk.weight.addressable_shards):
            assert sa.device == sb.device
            np.testing.assert_array_equal(np.asarray(untile_weight(sb.data)).view(np.uint8),
                                          np.asarray(sa.data).view(np.uint8), err_msg=key)
    assert {0, 1} <= dims  # both kinds of split were tiled
    assert short == ["['mtp']['draft_head']"]


@pytest.mark.slow  # ~116 s: interpret-mode kernels inside the TP2 shard_map; the shards' values are checked above
def test_tp2_tiled_tokens_equal_tp1(fp8_dir):
    """Greedy tokens with tiled weights: TP2 == TP1, plain and MTP K=2 (the kernels inside the TP2
    shard_map read each device's tiles)."""
    one, two = _load(fp8_dir, True), _load(fp8_dir, True, tp=2)
    for k in (0, 2):
        a, b = (qmtp.generate(m, [[1, 2, 3]], max_new_tokens=4, mtp_k=k) for m in (one, two))
        assert a.tokens == b.tokens, (k, a.tokens, b.tokens)


def test_tile_rows_fall_back_to_64():
    """fp8_layout.tile_rows_for: 128-row tiles where O allows, 64-row ones where only 64 divides O (a
    TP2 shard of 192 rows), the checkpoint layout otherwise; tile_as_loaded lays a weight out so."""
    import jax.numpy as jnp

    from pallas_kernels import fp8_layout
    assert [fp8_layout.tile_rows_for(o, 256) for o in (384, 192, 160)] == [128, 64, None]
    assert fp8_layout.tile_rows_for(384, 160) is None
    assert fp8_layout.tile_as_loaded(jnp.zeros((192, 256), jnp.float8_e4m3fn)).shape == (3, 2, 64, 128)
    assert fp8_layout.tile_as_loaded(jnp.zeros((160, 256), jnp.float8_e4m3fn)).shape == (160, 256)
    assert fp8_layout.tile_as_loaded(jnp.zeros((384, 256), jnp.float8_e4m3fn)).shape == (3, 2, 128, 128)
