"""The benchmark harness's arithmetic and outputs: bytes per step, rooflines, summary table, plot.

Roofline (PERFORMANCE.md), from the actual parameter tree and decode state:

    target_bytes = all target parameters except the embedding table (one row is read per token)
                   + GDN state read and written + conv state read and written + K/V of `context`
                   positions in every attention layer;      (per target pass of batch 1)
    draft_bytes  = the MTP subtree + the lm_head it shares + its K/V at `context` positions.
    MoE layers count the experts a pass reads: of X experts, each of B tokens choosing k, the expected
    number chosen at least once under uniform routing, X (1 - (1 - k/X)^B), is the read share.
    verify_bytes(K) = target_bytes of a pass of K+1 tokens per sequence: an MoE layer's experts read
                   for B (K+1) tokens, and the GDN and conv states read once and written after each
                   of the K+1 tokens (the commit ring's slots), so (K+2) times a state where a plain
                   step moves it twice.
    plain roofline       = 1 / (target_bytes / copy_bandwidth)                          tok/s
    MTP K ceiling at cumulative per-position acceptance p_1 >= ... >= p_K:
        tokens per round = 1 + sum_i p_i;  bytes per round = verify_bytes(K) + K * draft_bytes
        (K-1 draft steps, the verify pass, the draft refresh after the commit)
        ceiling          = (1 + sum_i p_i) / (bytes per round / copy_bandwidth)          tok/s
All bandwidth figures are the copy bandwidth measured in the same run. On a CPU that bandwidth is no
ceiling (a small model's weights stay in cache, and decoding runs above it): the plot leaves the
roofline and the ceilings out and the printed table the shares (the JSON keeps every figure).
"""

from __future__ import annotations

import json

import statistics

import numpy as np


def nbytes(tree) -> int:
    """Bytes one device holds of `tree`: a sharded array counts its shard (under TP each GPU streams
    only its shard per step, so the roofline is per GPU), anything else its whole shape."""
    import jax
    total = 0
    for a in jax.tree_util.tree_leaves(tree):
        sharding = getattr(a, "sharding", None)
        shape = sharding.shard_shape(a.shape) if hasattr(sharding, "shard_shape") else a.shape
        total += int(np.prod(shape)) * np.dtype(a.dtype).itemsize
    return total


def _unread_expert_bytes(tree, top_k: int | None, tokens: int) -> int:
    """Bytes of the MoE expert stacks in `tree` that a pass of `tokens` tokens does not read (module
    doc); 0 for a dense model (top_k None)."""
    import jax
    if top_k is None:
        return 0
    if isinstance(tree, (list, tuple)):
        return sum(_unread_expert_bytes(v, top_k, tokens) for v in tree)
    if not isinstance(tree, dict):
        return 0
    unread = sum(_unread_expert_bytes(v, top_k, tokens) for v in tree.values() if isinstance(v, (dict, list, tuple)))
    for key in ("experts_gate_up", "experts_down"):
        if key in tree:
            x = jax.tree_util.tree_leaves(tree[key])[0].shape[0]  # X experts
            unread += round(nbytes(tree[key]) * (1 - top_k / x) ** tokens)
    return unread


def step_bytes(params: dict, state, context: int, moe_top_k: int | None = None, verify_ks=()) -> dict:
    """Bytes one target pass and one MTP draft step over the state's whole batch must read (see the
    module docstring; weights once, state and K/V per sequence, every sequence at `context`);
    moe_top_k: the experts per token of an MoE model (its expert stacks count the share read);
    verify_ks: the K whose verify pass's bytes to add (`verify`, by str(K))."""
    kv_pos = sum(k.shape[2] * k.shape[3] * k.dtype.itemsize for k in state.kv.k) * 2  # K and V, per position
    mtp_kv_pos = sum(k.shape[2] * k.shape[3] * k.dtype.itemsize for k in state.mtp_kv.k) * 2
    lm_head = params["lm_head"] if "lm_head" in params else params["embed"]
    target_params = {k: v for k, v in params.items() if k not in ("embed", "mtp")}
    all_weights = nbytes(target_params) + (0 if "lm_head" in params else nbytes(lm_head))

    def target_pass(tokens: int, state_moves: int) -> dict:  # a pass of `tokens` tokens over the batch
        return {"weights": all_weights - _unread_expert_bytes(target_params, moe_top_k, tokens),
                "gdn_state": state_moves * nbytes(state.ssm), "conv_state": state_moves * nbytes(state.conv),
                "kv": kv_pos * context * state.batch}

    target = target_pass(state.batch, 2)  # the states read and written once
    mtp_params = params.get("mtp", {})
    # a draft reads the FP8 draft head when the model has one (qmtp.load's draft_head), else lm_head
    draft_head = mtp_params.get("draft_head", lm_head)
    mtp_layers = {k: v for k, v in mtp_params.items() if k != "draft_head"}
    draft = {"mtp_weights": nbytes(mtp_layers) - _unread_expert_bytes(mtp_layers, moe_top_k, state.batch),
             "lm_head": nbytes(draft_head), "kv": mtp_kv_pos * context * state.batch}
    verify = {}
    for k in verify_ks:  # K+1 tokens per sequence, the states read once and written after each
        parts = target_pass(state.batch * (k + 1), k + 2)
        verify[str(k)] = dict(parts, total=sum(parts.values()))
    return {"batch": state.batch, "target": target, "draft": draft, "target_total": sum(target.values()),
            "draft_total": sum(draft.values()), "verify": verify}


def roofline_tok_s(target_total: int, batch: int, copy_bytes_per_s: float) -> float:
    """Plain decoding at the bandwidth ceiling: `batch` tokens per target pass."""
    return batch * copy_bytes_per_s / target_total


def mtp_ceiling_tok_s(verify_total: int, draft_total: int, acceptance, batch: int, copy_bytes_per_s: float) -> float:
    """Tokens/s at the bandwidth ceiling for K = len(acceptance) drafts per round (verify_total: the
    verify pass's bytes at that K)."""
    k = len(acceptance)
    return batch * (1.0 + float(np.sum(acceptance))) * copy_bytes_per_s / (verify_total + k * draft_total)


def spread(values: list[float]) -> dict:
    """Median and spread of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": values}


def aligned(rows: list[list[str]]) -> str:
    """Rows of strings as left-aligned columns (the first row is the header)."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def platform_of(result: dict) -> str | None:
    """The platform a result was measured on ("cpu", "gpu", ...): its `platform`, or for a result
    that does not record it, the kind of its first device ("cpu:0", "cuda:0"); None when unknown."""
    if result.get("platform"):
        return result["platform"]
    device = (result.get("device") or [""])[0].lower()
    kinds = {"cpu": "cpu", "tfrt_cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}
    return next((v for k, v in kinds.items() if device.startswith(k)), None)


def has_ceiling(platform: str | None) -> bool:
    """Whether the copy bandwidth bounds decoding on this platform: not on a CPU, where the weights of
    a small model stay in cache (an unknown platform counts as a GPU)."""
    return platform != "cpu"


NO_CEILING = "not a ceiling on a CPU, where the weights fit in cache"


def heading(case: dict, copy_tb_s: float, platform: str | None) -> str:
    """The line above a case's table: engine, batch, prompt, and the roofline where it is one."""
    what = f"engine {case['engine']}, batch {case['batch']}, prompt {case['prompt_length']} tokens"
    if has_ceiling(platform):
        return f"{what} (roofline {case['roofline']['plain_tok_s']:.1f} tok/s, copy {copy_tb_s:.2f} TB/s):"
    return f"{what} (copy {copy_tb_s:.2f} TB/s, {NO_CEILING}: no shares of it):"


def table(modes: list[dict], shares: bool = True) -> str:
    """One line per mode: tok/s (median, min-max), speedup, TTFT, acceptance, roofline share (unless
    `shares` is False: a CPU run), and the device memory's high-water mark through the mode (GB; "-"
    where the backend keeps no statistics)."""
    head = ["mode", "K", "tok/s", "min-max", "speedup", "TTFT ms", "prefill tok/s", "floor", "acc.len",
            "per-position", "roofline", "peak GB"]
    rows = [head]
    for m in modes:
        tps = m["decode_tokens_per_s"]
        peak = (m.get("memory") or {}).get("peak_bytes_in_use")
        rows.append([m["name"], str(m["k"]), f"{tps['median']:.1f}", f"{tps['min']:.1f}-{tps['max']:.1f}",
                     f"{m.get('speedup', float('nan')):.2f}x", f"{m['ttft_s']['median'] * 1e3:.1f}",
                     f"{m['prefill_tokens_per_s']:.0f}" if m.get("prefill_tokens_per_s") else "-",
                     f"{m['prefill_share_of_floor']:.0%}" if m.get("prefill_share_of_floor") else "-",
                     f"{m['mean_accepted_length']:.2f}" if m["k"] else "-",
                     "/".join(f"{p:.2f}" for p in m.get("position_acceptance", [])) or "-",
                     f"{m['share_of_roofline']:.0%}" if m.get("share_of_roofline") is not None else "-",
                     f"{peak / 1e9:.1f}" if peak is not None else "-"])
    if not shares:  # no ceilings on a CPU: neither the roofline nor the matmul floor
        cut = {head.index("roofline"), head.index("floor")}
        rows = [[v for c, v in enumerate(r) if c not in cut] for r in rows]
    return aligned(rows)


def engine_comparison(cases: list[dict], engines: list[str]) -> list[dict]:
    """Per (batch, prompt length, mode): each engine's median decode tok/s and first / second."""
    by = {(c["engine"], c["batch"], c["prompt_length"], m["name"]): m["decode_tokens_per_s"]["median"]
          for c in cases for m in c["modes"]}
    out = []
    for c in (c for c in cases if c["engine"] == engines[0]):
        for m in c["modes"]:
            row = {"batch": c["batch"], "prompt_length": c["prompt_length"], "mode": m["name"],
                   "tok_s": {e: by.get((e, c["batch"], c["prompt_length"], m["name"])) for e in engines}}
            a, b = row["tok_s"][engines[0]], row["tok_s"][engines[1]]
            row["ratio"] = a / b if a and b else None
            out.append(row)
    return out


def engine_comparison_table(rows: list[dict], engines: list[str]) -> str:
    head = ["batch", "prompt", "mode", *engines, "ratio"]
    lines = [head] + [[str(r["batch"]), str(r["prompt_length"]), r["mode"],
                       *(f"{r['tok_s'][e]:.1f}" if r["tok_s"][e] else "-" for e in engines),
                       f"{r['ratio']:.2f}x" if r["ratio"] else "-"] for r in rows]
    return aligned(lines)


def plot(result: dict, path: str) -> str | None:
    """Writes figure(result) to `path` as a PNG; returns the path, or None when matplotlib is missing
    (the JSON has everything: `python -m qmtp.bench --plot_from=result.json` draws it later on any
    machine)."""
    return _write_png(lambda: figure(result), path)


def _write_png(draw, path: str) -> str | None:
    """Saves the matplotlib Figure draw() makes to `path` and closes it; the path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = draw()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def batch_lines(cases: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{line label: [(batch, median decode tokens/s), ...] by batch} for each mode run at two or more batch
    sizes (one engine and prompt length: the label is the mode's name; several: with them in brackets)."""
    groups = {(c.get("engine"), c["prompt_length"]) for c in cases}
    lines: dict[str, list[tuple[int, float]]] = {}
    for c in cases:
        for m in c["modes"]:
            label = m["name"] if len(groups) == 1 else f"{m['name']} ({c.get('engine')}, P{c['prompt_length']})"
            lines.setdefault(label, []).append((c["batch"], m["decode_tokens_per_s"]["median"]))
    return {label: sorted(pts) for label, pts in lines.items() if len({b for b, _ in pts}) > 1}


def plot_batches(result: dict, path: str) -> str | None:
    """Writes batch_figure(result) to `path` as a PNG; returns the path, or None where no mode ran at two
    batch sizes or matplotlib is missing."""
    lines = batch_lines(result["cases"])
    return _write_png(lambda: batch_figure(result, lines), path) if lines else None


def batch_figure(result: dict, lines: dict):
    """Tokens/s against batch, one line per mode (`batch_lines` of result["cases"]): a matplotlib Figure."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in lines.items():
        ax.plot(*zip(*pts), marker="o", label=label)
    batches = sorted({b for pts in lines.values() for b, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch (sequences decoded together)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(result["config"].get("title", "qmtp decode throughput") + ": tokens/s by batch", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figure(result: dict):
    """tokens/s vs K for natural and profiled acceptance (mtp_k="auto" modes as horizontal lines), with the
    plain roofline and the MTP ceilings drawn where the copy bandwidth is a ceiling (has_ceiling: not on
    a CPU, where the title says so instead): a matplotlib Figure (one axes); the caller saves and closes it."""
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    ceilings = has_ceiling(platform_of(result))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fixed = [m for m in result["modes"] if isinstance(m["k"], int)]
    for kind, marker in (("natural", "o"), ("profiled", "s")):
        pts = sorted((m["k"], m["decode_tokens_per_s"]["median"]) for m in fixed
                     if m["k"] == 0 or m["acceptance"] == kind)
        if len(pts) > 1:
            ax.plot(*zip(*pts), marker=marker, label=f"qmtp, {kind} acceptance")
        ceil = sorted((m["k"], m["ceiling_tok_s"]) for m in fixed
                      if m["k"] and m["acceptance"] == kind and m.get("ceiling_tok_s"))
        if ceil and ceilings:
            ax.plot(*zip(*ceil), linestyle=":", marker=marker, alpha=0.6, label=f"bandwidth ceiling, {kind}")
        for m in result["modes"]:
            if m["k"] == "auto" and m["acceptance"] == kind:
                ax.axhline(m["decode_tokens_per_s"]["median"], linestyle="-.", alpha=0.8, label=f"auto, {kind}")
    roof = result.get("roofline", {}).get("plain_tok_s")
    if roof and ceilings:
        ax.axhline(roof, color="gray", linestyle="--", label=f"plain roofline {roof:.0f} tok/s")
    ax.set_xlabel("MTP drafts per round K (0 = plain)")
    ax.set_ylabel(f"decode tokens/s (batch {result.get('batch', 1)})")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    title = result["config"].get("title", "qmtp decode throughput")
    ax.set_title(title if ceilings else f"{title}\n(copy bandwidth {NO_CEILING}: no ceilings drawn)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def breakdown_table(breakdown: dict) -> str:
    """Milliseconds per piece of a round, per K (qmtp.bench.breakdown), with the measured round, and what
    the verify pass costs in target steps."""
    names = ["target_step", "verify", "draft", "all_reduce", "predicted_round", "measured_round",
             "measured_plain_step"]
    names += [f"device_{n}" for n in names[:5]]  # busy time from a profiler trace (GPU runs)
    present = [n for n in names if any(n in v for v in breakdown.values())]
    rows = [["K"] + present + ["verify/step"]]
    for k, v in breakdown.items():
        ratio = verify_per_step(v)
        rows.append([k] + [f"{v[n] * 1e3:.3f}" if n in v else "-" for n in present]
                    + [f"{ratio:.2f}x" if ratio else "-"])
    return "milliseconds per piece of a round:\n" + aligned(rows)


def verify_per_step(pieces: dict) -> float | None:
    """A verify pass's time over a target step's (one K's breakdown pieces), None without both."""
    return pieces["verify"] / pieces["target_step"] if pieces.get("verify") and pieces.get("target_step") else None


def kernel_diff_table(pieces: dict, base: str = "target_step", other: str = "verify", top: int = 20) -> str:
    """Microseconds per iteration by launch kind in two pieces of the breakdown ({piece: {kind: {"us",
    "count"}}}, bench_breakdown.measure on a GPU) and their difference, the largest differences
    first: what a verify pass over K+1 tokens adds to a one-token target step, kind by kind."""
    a, b = pieces.get(base, {}), pieces.get(other, {})
    kinds = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, {}).get("us", 0.0) - a.get(n, {}).get("us", 0.0)))
    zero = {"us": 0.0, "count": 0.0}
    rows = [["launch kind", f"{base} us", "n", f"{other} us", "n", "difference us"]]
    for n in kinds[:top]:
        x, y = a.get(n, zero), b.get(n, zero)
        rows.append([n[:48], f"{x['us']:.1f}", f"{x['count']:g}", f"{y['us']:.1f}", f"{y['count']:g}",
                     f"{y['us'] - x['us']:+.1f}"])
    total = sum(v["us"] for v in b.values()) - sum(v["us"] for v in a.values())
    return (f"device time per iteration by launch kind, {other} against {base} "
            f"(summed kernel time {total:+.1f} us):\n" + aligned(rows))


def sampling_cost(sampled_runs, greedy_runs) -> dict:
    """A sampled mode's time per step (plain) or round (MTP) against its greedy twin's in the same run
    (each the median over the repeats of decode seconds / rounds), and what sampling adds: sampled /
    greedy - 1."""
    def per_round(runs):
        return float(np.median([r.stats["decode_s"] / max(r.stats["steps"], 1) for r in runs]))
    sampled, greedy = per_round(sampled_runs), per_round(greedy_runs)
    return {"sampled_round_s": sampled, "greedy_round_s": greedy, "sampling_cost": sampled / greedy - 1}


def sampling_cost_table(modes: list[dict]) -> str:
    """One line per mode with a greedy twin: ms per step or round, greedy and sampled, and the difference."""
    rows = [["mode", "greedy ms/round", "sampled ms/round", "sampling adds"]]
    rows += [[m["name"], f"{m['greedy_round_s'] * 1e3:.3f}", f"{m['sampled_round_s'] * 1e3:.3f}",
              f"{m['sampling_cost']:+.1%}"] for m in modes if "sampling_cost" in m]
    return aligned(rows)


TP2_SPEEDUP_TARGET = 1.6


def load_comparison(path: str) -> dict:
    """An earlier bench JSON to compare a run with (--compare_to); ValueError naming the file when it
    is missing, not JSON or has no cases."""
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as e:
        raise ValueError(f"--compare_to={path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--compare_to={path}: not a bench JSON ({e})") from None
    if not isinstance(result, dict) or not result.get("cases") or "config" not in result:
        raise ValueError(f"--compare_to={path}: not a qmtp.bench result (no config or cases)")
    return result


def compare(case: dict, tp: int, other: dict) -> dict | None:
    """This case against the other result's case of the same engine, batch and prompt length: each
    mode's tok/s over the same mode's there, and, for a TP2 run against a TP1 one, PERFORMANCE.md's
    TP2 >= 1.6x TP1 target on plain decode (a miss notes the TP2 step and its all-reduces from this
    run's breakdown). None when the other result has no such case."""
    key = lambda c: (c.get("engine"), c["batch"], c["prompt_length"])  # noqa: E731
    match = next((c for c in other["cases"] if key(c) == key(case)), None)
    if match is None:
        return None
    theirs = {m["name"]: m["decode_tokens_per_s"]["median"] for m in match["modes"]}
    rows = [{"mode": m["name"], "tok_s": m["decode_tokens_per_s"]["median"], "other_tok_s": theirs[m["name"]],
             "ratio": m["decode_tokens_per_s"]["median"] / theirs[m["name"]]}
            for m in case["modes"] if theirs.get(m["name"])]
    other_tp = other["config"].get("tp")
    out = {"other_tp": other_tp, "other_title": other["config"].get("title"), "modes": rows, "targets": []}
    plain = next((r for r in rows if r["mode"] == "plain"), None)
    if tp == 2 and other_tp == 1 and plain:
        value = plain["ratio"]
        row = {"target": "TP2 plain decode >= 1.6x TP1", "value": value, "goal": TP2_SPEEDUP_TARGET,
               "met": value >= TP2_SPEEDUP_TARGET, "note": ""}
        pieces = next(iter((case.get("breakdown") or {}).values()), {})
        if not row["met"] and {"measured_plain_step", "all_reduce"} <= pieces.keys():
            step, reduce = pieces["measured_plain_step"], pieces["all_reduce"]
            need = step * value / TP2_SPEEDUP_TARGET  # the step time at which the ratio reaches the goal
            row["note"] = (f"a TP2 step takes {step * 1e3:.2f} ms, its all-reduces {reduce * 1e3:.2f} ms of it; "
                           f"1.6x needs a step of {need * 1e3:.2f} ms ({(step - need) * 1e3:.2f} ms less)")
        out["targets"].append(row)
    return out


def comparison_table(comparison: dict, tp: int) -> str:
    other = f"TP{comparison['other_tp']}" if comparison.get("other_tp") else "other"
    rows = [["mode", f"TP{tp} tok/s", f"{other} tok/s", "ratio"]]
    rows += [[r["mode"], f"{r['tok_s']:.1f}", f"{r['other_tok_s']:.1f}", f"{r['ratio']:.2f}x"]
             for r in comparison["modes"]]
    return aligned(rows)
