"""The converted-parameter cache (`qmtp.load(..., converted_cache=DIR)`, qmtp.model.converted_cache) on two
fake CPU devices: the second load restores the tree without reading the safetensors and is bitwise
equal to an uncached load (FP8 weights and scales included, same shardings for tp = 2); a changed
checkpoint misses; a corrupt entry falls back to the checkpoint and is rewritten; greedy tokens match.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import qmtp
from qmtp.model import checkpoint, converted_cache
from qmtp.model.fp8 import Fp8Block
from qmtp.tools import make_checkpoint


@pytest.fixture(scope="module", autouse=True)
def two_devices():
    # conftest.py provides 2 CPU devices; a silent skip would hide every tensor-parallel test
    assert len(jax.devices()) >= 2, "needs 2 devices (jax_num_cpu_devices=2 in conftest.py)"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint.write_checkpoint(str(tmp_path_factory.mktemp("cc") / "ck"), "tiny_tp", "fp8", seed=1)


@pytest.fixture(scope="module")
def reference(ckpt):
    """Uncached loads (no cache argument at all) per tp; module-scoped, so made before any spy."""
    return {tp: qmtp.load(ckpt, progress=False, tp=tp) for tp in (1, 2)}


@pytest.fixture
def reads(monkeypatch):
    """Paths the safetensors reader `qmtp.model.checkpoint.load` was called with."""
    calls, real = [], checkpoint.load

    def spy(checkpoint_dir, *args, **kwargs):
        calls.append(checkpoint_dir)
        return real(checkpoint_dir, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "load", spy)
    return calls


def _assert_bitwise_equal(got, want, tp: int):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    n_fp8 = sum(isinstance(x, Fp8Block) for x in jax.tree_util.tree_leaves(
        want, is_leaf=lambda x: isinstance(x, Fp8Block)))
    assert n_fp8 > 0, "the test checkpoint should have FP8 weights"
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
        name = jax.tree_util.keystr(path)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert a.sharding == b.sharding, f"{name}: {a.sharding} != {b.sharding}"
        if tp > 1:
            assert a.sharding.spec == b.sharding.spec, name
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), name


def _entry(cache: str) -> str:
    (entry,) = [e for e in os.listdir(cache) if not e.startswith(".")]
    return os.path.join(cache, entry)


@pytest.mark.parametrize("tp", [1, 2])
def test_second_load_hits_and_is_bitwise_equal(ckpt, reference, tmp_path, reads, capsys, tp):
    cache = str(tmp_path / "cache")
    first = qmtp.load(ckpt, tp=tp, converted_cache=cache)
    assert reads == [ckpt] and "miss" in capsys.readouterr().err
    entry = _entry(cache)
    assert os.path.basename(entry) == converted_cache.cache_key(ckpt, "bfloat16", tp)
    assert os.path.isfile(os.path.join(entry, "meta.json"))
    assert not [e for e in os.listdir(cache) if e.startswith(".")], "temporary entry left behind"

    second = qmtp.load(ckpt, tp=tp, converted_cache=cache)
    assert reads == [ckpt], "the second load read the safetensors"
    assert f"hit {entry}" in capsys.readouterr().err
    assert second.cfg == first.cfg and second.tp == tp
    _assert_bitwise_equal(first.params, reference[tp].params, tp)
    _assert_bitwise_equal(second.params, reference[tp].params, tp)


def test_key_covers_files_dtype_and_tp(ckpt, tmp_path):
    path = shutil.copytree(ckpt, tmp_path / "ck")
    key = converted_cache.cache_key(str(path), "bfloat16", 1)
    assert converted_cache.cache_key(str(path), "bfloat16", 1) == key
    others = {converted_cache.cache_key(str(path), "float32", 1), converted_cache.cache_key(str(path), "bfloat16", 2),
              converted_cache.cache_key(ckpt, "bfloat16", 1)}
    assert len(others | {key}) == 4
    st = os.stat(path / "model.safetensors")
    os.utime(path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # same size
    assert converted_cache.cache_key(str(path), "bfloat16", 1) != key


def test_changed_checkpoint_misses(ckpt, reference, tmp_path, reads):
    path = str(shutil.copytree(ckpt, tmp_path / "ck"))
    cache = str(tmp_path / "cache")
    qmtp.load(path, tp=2, converted_cache=cache, progress=False)
    config = os.path.join(path, "config.json")
    with open(config) as f:
        raw = json.load(f)
    with open(config, "w") as f:  # same model, rewritten: new size and mtime
        json.dump(raw, f, indent=1)
    model = qmtp.load(path, tp=2, converted_cache=cache, progress=False)
    assert reads == [path, path], "a changed checkpoint must miss the cache"
    assert len([e for e in os.listdir(cache) if not e.startswith(".")]) == 2
    _assert_bitwise_equal(model.params, reference[2].params, 2)


def _truncate_largest(entry):
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(entry, "state")) for f in fs]
    largest = max(files, key=os.path.getsize)
    os.truncate(largest, os.path.getsize(largest) // 2)


def _delete_data_file(entry):
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(entry, "state")) for f in fs
             if os.sep + "d" + os.sep in os.path.join(d, f)]
    assert files
    os.remove(sorted(files)[0])


def _garbage_meta(entry):
    with open(os.path.join(entry, "meta.json"), "w") as f:
        f.write('{"format_version": 1, "key": ')


def _garbage_manifest(entry):
    # same size, so only the reader itself (OCDBT's checksums) can notice
    path = os.path.join(entry, "state", "manifest.ocdbt")
    with open(path, "r+b") as f:
        f.write(b"\xa5" * os.path.getsize(path))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's tasks after a failed read
@pytest.mark.parametrize("corrupt,reason", [(_truncate_largest, "missing or resized files"),
                                            (_delete_data_file, "missing or resized files"),
                                            (_garbage_meta, "JSONDecodeError"), (_garbage_manifest, "")],
                         ids=["truncated", "deleted", "meta", "manifest"])
def test_corrupt_entry_falls_back_and_is_rewritten(ckpt, reference, tmp_path, reads, capfd, corrupt, reason):
    cache = str(tmp_path / "cache")
    qmtp.load(ckpt, converted_cache=cache, progress=False)
    entry = _entry(cache)
    corrupt(entry)
    capfd.readouterr()
    model = qmtp.load(ckpt, converted_cache=cache, progress=False)
    err = capfd.readouterr().err
    assert f"{entry} is unreadable (" in err and reason in err, err[-2000:]
    assert reads == [ckpt, ckpt], "a corrupt entry must fall back to the checkpoint"
    _assert_bitwise_equal(model.params, reference[1].params, 1)
    again = qmtp.load(ckpt, converted_cache=cache, progress=False)  # the entry was rewritten
    assert reads == [ckpt, ckpt]
    _assert_bitwise_equal(again.params, reference[1].params, 1)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # CI time
def test_cached_model_generates_the_same_tokens(ckpt, reference, tmp_path, reads, tp):
    cache = str(tmp_path / "cache")
    qmtp.load(ckpt, tp=tp, converted_cache=cache, progress=False)
    cached = qmtp.load(ckpt, tp=tp, converted_cache=cache, progress=False)
    assert reads == [ckpt]
    want = qmtp.generate(reference[tp], [[5, 6, 7]], max_new_tokens=4).tokens
    got = qmtp.generate(cached, [[5, 6, 7]], max_new_tokens=4).tokens
    assert got == want and len(want[0]) == 4


def test_failed_write_leaves_no_entry(ckpt, tmp_path, monkeypatch, capfd):
    """A save that dies after orbax wrote the arrays leaves nothing a later load would accept (and a
    dead writer's temporary directory is swept by the next save)."""
    import socket
    import subprocess
    import sys
    cache = tmp_path / "cache"
    key = converted_cache.cache_key(ckpt, "bfloat16", 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = cache / f".{key}.tmp-{socket.gethostname()}-{int(dead.stdout)}-deadbeef"
    os.makedirs(stale / "state")

    def crash(root):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(converted_cache, "_file_sizes", crash)
    qmtp.load(ckpt, converted_cache=str(cache), progress=False)
    assert "cannot write" in capfd.readouterr().err
    assert os.listdir(cache) == [], "a failed or stale write left something behind"
    monkeypatch.undo()
    qmtp.load(ckpt, converted_cache=str(cache), progress=False)  # a clean miss, then a hit
    assert converted_cache.load(str(cache), key, converted_cache.read_config(ckpt)) is not None
