"""JAX's persistent compilation cache for qmtp's command lines (generate, bench, server).

At the Qwen3.5-27B shapes a speculative loop compiles in ~100 s (every Pallas kernel is a Triton
compile); with the cache, a later process that builds the same program loads it from disk. JAX keys
an entry by the whole program, the JAX version, the device, the compile options and XLA_FLAGS, so a
changed kernel, shape or flag compiles afresh. Programs that compiled in under MIN_COMPILE_S are not
written; the directory stays under MAX_BYTES (JAX's LRU; JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
and JAX_COMPILATION_CACHE_MAX_SIZE override both).

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
