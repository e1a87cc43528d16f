"""Reporting of a qmtp.train run: the stderr progress line, the metrics.jsonl reader and the
loss.png plot of the target and MTP losses and the held-out MTP acceptance.
"""

from __future__ import annotations

import json
import os
import sys
import time


def fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """One stderr line: step, losses, MTP acceptance, tokens/s, elapsed and ETA (a redrawn line on a tty)."""

    def __init__(self, total: int, start: int):
        self.total, self.start, self.t0 = total, start, time.monotonic()
        self.tty = sys.stderr.isatty()

    def show(self, step: int, m: dict, tok_s: float) -> None:
        elapsed = time.monotonic() - self.t0
        eta = elapsed / max(step - self.start, 1) * (self.total - step)
        width = len(str(self.total))
        line = (f"step {step:>{width}}/{self.total} {100 * step / self.total:5.1f}% | loss {m['loss']:.4f} "
                f"(main {m['main']:.4f}, mtp {m['mtp']:.4f}) | accept {m['accept']:.3f} | "
                f"{f'{tok_s:,.0f}' if tok_s else '-'} tok/s | "
                f"{fmt_time(elapsed)} elapsed, ETA {fmt_time(eta)}")
        print(("\r" + line + "\033[K") if self.tty else line, end="" if self.tty else "\n", file=sys.stderr,
              flush=True)

    def newline(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def read_metrics(path: str, upto: int) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def plot_curves(rows: list[dict], path: str) -> None:
    """Target and MTP loss (train and held-out) and held-out MTP acceptance against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, style in (("train", "-"), ("eval", "o--")):
        r = [x for x in rows if x["kind"] == kind]
        if r:
            steps = [x["step"] for x in r]
            ax.plot(steps, [x["main"] for x in r], style, label=f"target (next token), {kind}", color="C0",
                    alpha=0.8 if kind == "train" else 1.0)
            ax.plot(steps, [x["mtp"] for x in r], style, label=f"MTP (token after next), {kind}", color="C1",
                    alpha=0.8 if kind == "train" else 1.0)
            ax2.plot(steps, [x["accept"] for x in r], style, label=kind, color="C2" if kind == "eval" else "C7")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="losses")
    ax.grid(alpha=0.3)
    ax.legend()
    ax2.set(xlabel="step", ylabel="share", title="teacher-forced first-draft acceptance", ylim=(0, 1))
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
