"""Prints the --kernels flag of the fastest impl="pallas" variant in a step-bench result
(`python -m pallas_kernels.bench --parts=step --step_impls=...`), or nothing when the defaults
("pallas") won or no variant ran: lets one GPU session run its end-to-end tables with the winner
before it becomes a default.

  python scripts/best_step_variant.py bench_step.json   ->   --kernels=fp8_scale_preload=False
"""

from __future__ import annotations

import json
import sys


def best_flag(result: dict) -> str:
    from pallas_kernels.bench.step import VARIANTS
    rows = [r for r in result.get("rows", []) if r.get("kernel") == "decode_step" and r.get("impl") in VARIANTS
            and "error" not in r and r.get("s_per_step")]
    if not rows:
        return ""
    best = min(rows, key=lambda r: r["s_per_step"])
    overrides = VARIANTS[best["impl"]]
    return "--kernels=" + ",".join(f"{k}={v}" for k, v in overrides.items()) if overrides else ""


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        with open(argv[1]) as f:
            print(best_flag(json.load(f)))
    except (OSError, ValueError) as e:  # no result: the defaults
        print(f"best_step_variant: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
