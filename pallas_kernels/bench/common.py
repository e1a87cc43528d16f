"""Shared pieces of `python -m pallas_kernels.bench`: timing, the result recorder, the summary table.

Every figure is a ratio to the copy bandwidth measured in the same process (copy_bandwidth); small
operations are timed inside one jitted program that runs them many times over inputs larger than
the L2 cache, so neither host dispatch nor cache hits are measured.
"""

from __future__ import annotations

import json
import statistics
import time

L2_BYTES = 50 * 2**20  # H200 L2 cache


def copy_bandwidth(gib: float, trials: int) -> dict:
    """The ceiling every figure is a share of: bytes moved per second by a jitted x + 1 over `gib` GiB of
    f32 (read + write), from the fastest of `trials` timed calls (noise only ever lengthens a trial)."""
    import jax
    import jax.numpy as jnp
    n = int(gib * (1 << 28))  # f32 elements
    med, best = timed(jax.jit(lambda a: a + 1), jnp.zeros((n,), jnp.float32), trials=trials)
    return {"bytes": 2 * n * 4, "median_s": med, "best_s": best, "tb_per_s": 2 * n * 4 / best / 1e12,
            "tb_per_s_median": 2 * n * 4 / med / 1e12}


def timed(fn, *args, trials: int) -> tuple[float, float]:
    """(median, best) wall seconds of `trials` blocked calls, after one warm-up call (the compile)."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


class Recorder:
    """Collects rows, prints each as one JSON line when measured, rewrites the JSON file after each
    row (a run cut by a time limit keeps everything measured so far)."""

    def __init__(self, path: str, header: dict):
        self.path, self.results = path, dict(header, rows=[])

    def set(self, key: str, value) -> None:
        self.results[key] = value
        print(json.dumps({key: value}), flush=True)
        self.save()

    def emit(self, row: dict) -> None:
        self.results["rows"].append(row)
        print(json.dumps(row), flush=True)
        self.save()

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.results, f, indent=2)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def summary_table(rows: list[dict]) -> str:
    """One line per row: kernel, case, impl, time, achieved rate and share of the copy bandwidth,
    and, where measured, the kernel's device time and its share (kernel_us, kernel_share)."""
    cols = ["kernel", "case", "impl", "us", "tb_s", "share_of_copy", "tflop_s", "kernel_us", "kernel_share", "note"]
    lines = []
    for r in rows:
        note = r.get("error", "")[:60] or (r.get("config", "") if not r.get("default", True) else "")
        lines.append([r.get("kernel", ""), r.get("case", ""), r.get("impl", ""),
                      r["s_per_call"] * 1e6 if r.get("s_per_call") is not None else "", r.get("tb_s", ""),
                      r.get("share_of_copy", ""), r.get("tflop_s", ""),
                      r["kernel_s_per_call"] * 1e6 if r.get("kernel_s_per_call") is not None else "",
                      r.get("kernel_share_of_copy", ""), note])
    table = [cols] + [[_fmt(v) for v in line] for line in lines]
    widths = [max(len(row[c]) for row in table) for c in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in table)
