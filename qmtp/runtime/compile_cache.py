"""JAX's persistent compilation cache for qmtp's command lines (generate, bench, server).

A process compiles its prefill and decode loops before the first token; at the Qwen3.5-27B shapes
a speculative loop takes ~100 s (every Pallas kernel is a Triton compile; H200). With
the cache on, a later process that builds the same program loads the executable from disk instead.
JAX keys an entry by the whole program (the HLO, which embeds every Pallas kernel), the JAX and
jaxlib versions, the device kind, the compile options and XLA_FLAGS: a changed kernel, kernel
setting, shape or flag compiles afresh, so a stale entry cannot be run. Only programs that took at
least MIN_COMPILE_S to compile are written (small helper programs are not worth the files), and the
directory is kept under MAX_BYTES by evicting the least recently used entries (JAX's LRU). JAX's
environment variables JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS and JAX_COMPILATION_CACHE_MAX_SIZE
override both.

Directory: `--compile_cache` (default "auto": $QMTP_CACHE/jax_compile, $QMTP_CACHE defaulting to
~/.cache/qmtp; "off" turns the cache off; anything else is a directory). The Python API leaves
JAX's configuration alone unless `enable()` is called.
"""

from __future__ import annotations

import os

AUTO = "auto"
OFF = ("off", "none", "")
MIN_COMPILE_S = 1.0  # JAX's own default threshold, stated here so the module doc stays true
SUBDIR = "jax_compile"
MAX_BYTES = 10 * 2**30  # kernel-setting experiments each add entries; a bound keeps the directory finite


def resolve(value: str | None) -> str | None:
    """The cache directory that `value` (the flag's text) names, or None for off."""
    if value is None or value.strip().lower() in OFF:
        return None
    if value == AUTO:
        from qmtp.tools.make_checkpoint import default_cache_dir
        return os.path.join(default_cache_dir(), SUBDIR)
    return os.path.abspath(os.path.expanduser(value))


def enable(directory: str) -> str:
    """Turns JAX's persistent compilation cache on in `directory` (created if missing) for this
    process; returns the directory. OSError naming it when it cannot be created or written."""
    import jax
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OSError(f"--compile_cache={directory}: cannot create the directory ({e.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise OSError(f"--compile_cache={directory}: the directory is not writable")
    jax.config.update("jax_compilation_cache_dir", directory)
    for name, value in (("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S),
                        ("jax_compilation_cache_max_size", MAX_BYTES)):
        if name.upper() not in os.environ:  # JAX's own environment variable wins
            jax.config.update(name, value)
    return directory
