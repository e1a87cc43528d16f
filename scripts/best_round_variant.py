#!/usr/bin/env python3
"""Prints the kernel settings (name=value,...) that combine the --variants of a round_pieces result
(`scripts/round_pieces.py --variants=...`) whose verify + commit time beat the defaults' by more than
MARGIN, or nothing when none did; for gpu_session.sh, which runs the end-to-end table with them
(`--kernels=<output>`) before they become defaults. Device busy time when the run had a GPU, else
wall clock. Variants that set a common name exclude each other: the fastest of them is taken.

  python scripts/best_round_variant.py round_pieces.json   ->   gdn_conv_hoisted=true,bf16_reduce_max_out=256
"""

from __future__ import annotations

import json
import sys

MARGIN = 0.01  # a variant must beat the defaults by more than 1% of verify + commit (run-to-run noise)


def round_cost(pieces: dict) -> float | None:
    """verify + commit seconds (device time when measured), None when either is missing."""
    for prefix in ("device_", ""):
        if f"{prefix}verify" in pieces and f"{prefix}commit" in pieces:
            return pieces[f"{prefix}verify"] + pieces[f"{prefix}commit"]
    return None


def best_settings(result: dict) -> str:
    base = round_cost(result.get("pieces", {}))
    if base is None:
        return ""
    winners = []
    for text, measured in result.get("variants", {}).items():
        cost = round_cost(measured.get("pieces", {}))
        if cost is not None and cost < base * (1 - MARGIN):
            winners.append((cost, text))
    chosen, names = [], set()
    for _, text in sorted(winners):
        items = [item.strip() for item in text.split(",") if item.strip()]
        these = {item.partition("=")[0].strip() for item in items}
        if these & names:
            continue
        chosen += items
        names |= these
    return ",".join(chosen)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        print(best_settings(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
