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


def describe(copy: dict) -> str:
    """One line for a run's log: the ceiling, the median, the in-program figures."""
    loop = copy["in_program"]
    return (f"copy bandwidth {copy['tb_per_s']:.3f} TB/s (fastest of the trials; median {copy['tb_per_s_median']:.3f}; "
            f"in one program: fastest {loop['tb_per_s_best']:.3f}, median {loop['tb_per_s_median']:.3f})")


def copy_bandwidth(gib: float = 4.0, trials: int = 10) -> dict:
    """Bytes moved per second by x + 1 over `gib` GiB of f32 (after one warm-up call).

    Returns bytes, median_s, best_s, tb_per_s (the ceiling: from the fastest trial) and
    tb_per_s_median (for the record)."""
    n = int(gib * (1 << 28))  # f32 elements
    x = jnp.zeros((n,), jnp.float32)
    nbytes = 2 * n * 4
    med, best = median_and_fastest(jax.jit(lambda a: a + 1), x, trials, passes=1)
    # the same copy timed with one dispatch per IN_PROGRAM_PASSES passes (recorded next to the
    # host-timed ceiling, to compare how steady the two are)
    loop_med, loop_best = median_and_fastest(jax.jit(one_program_passes, static_argnums=1), x, trials,
                                              passes=IN_PROGRAM_PASSES)
    return {"bytes": nbytes, "median_s": med, "best_s": best, "tb_per_s": nbytes / best / 1e12,
            "tb_per_s_median": nbytes / med / 1e12, "in_program": {
                "passes": IN_PROGRAM_PASSES, "median_s_per_pass": loop_med, "best_s_per_pass": loop_best,
                "tb_per_s_median": nbytes / loop_med / 1e12, "tb_per_s_best": nbytes / loop_best / 1e12}}


def median_and_fastest(f, x: jax.Array, trials: int, passes: int) -> tuple[float, float]:
    """Seconds per pass of f(x) (or f(x, passes) when passes > 1), median and fastest of `trials`
    timed calls after one warm-up call."""
    call = (lambda: f(x)) if passes == 1 else (lambda: f(x, passes))
    call().block_until_ready()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        call().block_until_ready()
        times.append((time.perf_counter() - t0) / passes)
    return statistics.median(times), min(times)


# x + 1 passes per timed call of the in-program measurement: one dispatch (~85 us on the H200) per
# IN_PROGRAM_PASSES x ~2.2 ms, under 0.5%
IN_PROGRAM_PASSES = 8


def one_program_passes(x: jax.Array, passes: int) -> jax.Array:
    """x + 1, `passes` times, in one program: the first pass into a new array, the rest in a while
    loop over it (a loop over x itself would first copy x, an uncounted pass). The optimization
    barrier keeps every pass a separate read and write of the whole array (without it XLA may fold
    the passes into one x + n)."""
    first = jax.lax.optimization_barrier(x + 1)
    return jax.lax.fori_loop(1, passes, lambda _, a: jax.lax.optimization_barrier(a + 1), first)

