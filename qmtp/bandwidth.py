"""The copy ceiling every benchmark quotes: jitted `x + 1` over a large f32 array (read + write).

Measured in the same process as the figures it normalizes (PERFORMANCE.md): a ratio to this number
is what qmtp reports, never an absolute claim. The ceiling is the fastest of the trials: each trial is
timed from the host, so noise (dispatch, a busy neighbour, clocks) only ever lengthens one, and the
fastest is the closest to what the memory can do. The median moved by up to 15% between runs on the
same H200 (3.22-3.74 TB/s, 2026-11-30) while the fastest stayed within 3.71-3.97; a share of a low
median flattered every figure quoted against it.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def copy_bandwidth(gib: float = 4.0, trials: int = 10) -> dict:
    """Bytes moved per second by x + 1 over `gib` GiB of f32 (after one warm-up call).

    Returns bytes, median_s, best_s, tb_per_s (the ceiling: from the fastest trial) and
    tb_per_s_median (for the record)."""
    n = int(gib * (1 << 28))  # f32 elements
    x = jnp.zeros((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    f(x).block_until_ready()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    del x
    nbytes = 2 * n * 4
    med, best = statistics.median(times), min(times)
    return {"bytes": nbytes, "median_s": med, "best_s": best, "tb_per_s": nbytes / best / 1e12,
            "tb_per_s_median": nbytes / med / 1e12}
