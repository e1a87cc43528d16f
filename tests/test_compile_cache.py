"""--compile_cache (qmtp.runtime.compile_cache): a second process loads its programs from the cache instead of
compiling them, `off` writes nothing, and a directory that cannot be used is named in the error."""

import os
import subprocess
import sys

import pytest

from qmtp.runtime import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(cache, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", QMTP_CACHE=str(cache), PYTHONPATH=ROOT,
               JAX_DEBUG_LOG_MODULES="jax._src.compiler",  # JAX logs each persistent-cache hit and miss
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # every program, however fast its compile
    return subprocess.run([sys.executable, "-m", "qmtp.generate", "--flagfile=configs/tiny.flags",
                           "--max_new_tokens=3", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_second_process_loads_the_loops_from_the_cache(tmp_path):
    first = generate(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    entries = os.listdir(tmp_path / compile_cache.SUBDIR)
    assert any(e.startswith("jit_decode-") for e in entries), entries
    assert "cache hit for 'jit_decode'" not in first.stderr
    second = generate(tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "cache hit for 'jit_decode'" in second.stderr and "cache hit for 'jit_prefill'" in second.stderr
    assert first.stdout.split("\n")[:2] == second.stdout.split("\n")[:2]  # the same text


@pytest.mark.slow  # CI time: the cache's hit across processes stays in CI
def test_off_writes_no_cache(tmp_path):
    r = generate(tmp_path, "--compile_cache=off")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (tmp_path / compile_cache.SUBDIR).exists()
    assert "cache hit" not in r.stderr


def test_resolve_names_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("QMTP_CACHE", str(tmp_path))
    assert compile_cache.resolve("auto") == os.path.join(str(tmp_path), compile_cache.SUBDIR)
    assert compile_cache.resolve("off") is None and compile_cache.resolve("") is None
    assert compile_cache.resolve("~/x") == os.path.join(os.path.expanduser("~"), "x")


def test_unusable_directory_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="--compile_cache=.*file/sub: cannot create"):
        compile_cache.enable(str(blocker / "sub"))
