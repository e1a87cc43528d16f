"""Prints the --kernels flag that combines every impl="pallas" variant of a step-bench result
(`python -m pallas_kernels.bench --parts=step --step_impls=...`) that beat the defaults ("pallas")
by more than MARGIN, or nothing when none did: lets one GPU session run its end-to-end tables with
the winners before they become defaults. The variants each change one policy (the GDN conv or
gates in the recurrence kernel, the split-K target), so their gains are expected to add; the
end-to-end table that runs with the combined flag measures whether they do. Without a "pallas" row,
the fastest variant alone.

  python scripts/best_step_variant.py bench_step.json   ->   --kernels=fp8_scale_preload=False,fp8_decode_programs_per_sm=4
"""

from __future__ import annotations

import json
import sys


MARGIN = 0.01  # a variant must beat the defaults by more than 1% of the step (run-to-run noise)


def best_flag(result: dict) -> str:
    from pallas_kernels.bench.step import VARIANTS
    rows = [r for r in result.get("rows", []) if r.get("kernel") == "decode_step" and r.get("impl") in VARIANTS
            and "error" not in r and r.get("s_per_step")]
    if not rows:
        return ""
    default = next((r["s_per_step"] for r in rows if r["impl"] == "pallas"), None)
    if default is None:
        winners = [min(rows, key=lambda r: r["s_per_step"])]
    else:
        winners = [r for r in rows if r["impl"] != "pallas" and r["s_per_step"] < default * (1 - MARGIN)]
    overrides: dict = {}
    for row in sorted(winners, key=lambda r: -r["s_per_step"]):  # the faster variant's value wins a shared name
        overrides.update(VARIANTS[row["impl"]])
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
