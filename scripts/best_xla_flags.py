"""Prints the XLA_FLAGS that join every setting whose decode step beat the run without XLA flags by
more than MARGIN, or nothing when none did. Each argument is a step-bench result
(`XLA_FLAGS=... python -m pallas_kernels.bench --parts=step --step_impls=pallas --out=F`), which
records the XLA_FLAGS it ran with; the one with none is the baseline. The settings each change one
XLA pass (a fusion rewriter, command buffers), so a lease runs the end-to-end table once with all
winners together, which measures whether their gains add.

  python scripts/best_xla_flags.py step_xla_*.json   ->   --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL
"""

from __future__ import annotations

import json
import sys

MARGIN = 0.01  # a setting must beat the baseline by more than 1% of the step (run-to-run noise)


def step_seconds(result: dict) -> float | None:
    """The default Pallas step's seconds per step in a step-bench result (None if it did not run)."""
    return next((r["s_per_step"] for r in result.get("rows", [])
                 if r.get("kernel") == "decode_step" and r.get("impl") == "pallas" and r.get("s_per_step")), None)


def best_flags(results: list[dict]) -> str:
    timed = [(r.get("xla_flags", "").strip(), step_seconds(r)) for r in results]
    timed = [(flags, s) for flags, s in timed if s]
    base = next((s for flags, s in timed if not flags), None)
    if base is None:
        return ""
    return " ".join(flags for flags, s in sorted(timed, key=lambda fs: fs[1]) if flags and s < base * (1 - MARGIN))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    results = []
    for path in argv[1:]:
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as e:  # a setting that failed (an unknown flag): not a candidate
            print(f"best_xla_flags: {path}: {e}", file=sys.stderr)
    print(best_flags(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
