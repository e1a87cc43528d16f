"""The FP8 matmuls of one 27B decode step as the step launches them, against the copy bandwidth.

The per-weight rows of fp8.py time each weight shape alone, but the step never launches k_proj or
v_proj ([1024, 5120], 5 MB) or in_proj_z alone: projections that read the same x share one launch
(fp8_matmul_many, one grid over all of them), which is what the bandwidth of a launch has to be
judged on. LAUNCH_GROUPS are the model's shared launches; `step_launches` checks that they cover
every FP8 projection of fp8.PROJECTIONS exactly once.

Per launch and row count M: one jitted program loops over n distinct weight sets (>= 8x the L2
cache together, as in fp8.py), calling fp8_matmul_many with the default config; figures per call:
the wall clock, and on the GPU the Pallas kernel's device time (its own launches) and the busy time
of every kernel of the call (the split-K sum and the x pieces included; summed per step as busy_s).
share_of_copy = summed weight bytes / time / copy bandwidth. `target_lines` compares the kernel share
with TARGET_SHARE.

Per launch also its read floor (read_floor.py, `floor=True`): the fastest a kernel that only reads
the launch's bytes in one launch of the same kind of grid gets, as a share of copy, and each
launch's share of that floor (share_of_floor). It tells a launch that is short of the target because
of what the FP8 kernel does from one that is short because one launch of that many bytes cannot get
there.
"""

from __future__ import annotations

import functools
import math

from pallas_kernels.bench.common import L2_BYTES, timed

# per layer kind: the FP8 projections one launch serves (the model's attention, gated_deltanet, mlp)
LAUNCH_GROUPS = {
    "attn": (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("mlp_gate", "mlp_up"), ("mlp_down",)),
    "gdn": (("in_proj_qkv", "in_proj_z"), ("out_proj",), ("mlp_gate", "mlp_up"), ("mlp_down",)),
}
TARGET_SHARE = 0.80  # each FP8 launch at 1-16 rows streams >= 80% of the measured copy bandwidth
DECODE_MS = (1, 4, 16)


def step_launches() -> list[dict]:
    """[{name, shapes [(O, I)], count (per step)}] for every FP8 launch of one 27B decode step;
    ValueError if LAUNCH_GROUPS misses or repeats a projection of fp8.PROJECTIONS."""
    from pallas_kernels.bench.fp8 import LAYERS, PROJECTIONS

    launches = []
    for kind, groups in LAUNCH_GROUPS.items():
        grouped = [k for g in groups for k in g]
        if sorted(grouped) != sorted(PROJECTIONS[kind]):
            raise ValueError(f"LAUNCH_GROUPS[{kind!r}] covers {sorted(grouped)}, but the layer's FP8 "
                             f"weights are {sorted(PROJECTIONS[kind])}")
        for group in groups:
            launches.append({"name": f"{kind}.{'+'.join(group)}", "count": LAYERS[kind],
                             "shapes": [PROJECTIONS[kind][k] for k in group]})
    return launches


def launch_output(x, ws, ss, interpret: bool = False):
    """One launch's outputs reduced to [M, 1] for loop_program: the first column of every output,
    summed. Each output must reach the result: a GEMM launch is one pallas_call per weight (the
    decode grid is one for all), and XLA removes a call whose output is never read."""
    from pallas_kernels import fp8_matmul as fm
    return sum(y[:, :1].astype("float32") for y in fm.fp8_matmul_many(x, ws, ss, interpret=interpret))


LAYOUTS = ("checkpoint", "tiled")  # the weights as the checkpoint stores them, or fp8_layout's tiles


def run(copy_tb_s: float, emit, *, quick: bool = False, interpret: bool = False, decode_ms=DECODE_MS,
        reps: int = 8, trials: int = 5, device_time: bool = True, floor: bool = True,
        layouts=("tiled",)) -> dict:
    """Emits one row per (launch, M, layout), and with `floor` one read_floor row per launch first (over
    the tiled floor configs too when "tiled" is among `layouts`); returns {"per_step": {key: figures of
    all launches of a step}, "targets": {key: [launches whose share is below TARGET_SHARE, with their
    read floor's share where measured]}}, key M for the checkpoint layout and "M tiled" for the tiled
    one (shares by device time where measured, else by the wall clock)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import fp8_config, fp8_layout
    from pallas_kernels import fp8_matmul as fm
    from pallas_kernels.bench import read_floor
    from pallas_kernels.bench.fp8 import _device_figures, loop_program, make_weights

    launches = step_launches()
    if quick:  # two ragged projections behind one x, and one alone
        launches = [{"name": "quick.a+b", "shapes": [(272, 300), (130, 300)], "count": 1},
                    {"name": "quick.c", "shapes": [(130, 129)], "count": 1}]
        if "tiled" in layouts:  # tile_weight needs whole tiles
            launches = [{"name": "quick.d+e", "shapes": [(128, 256), (64, 256)], "count": 1}]
        reps, trials = 1, 1
    per_step: dict = {}
    below: dict = {}
    floors: dict = {}  # (shapes): the read floor, measured once per distinct launch shape

    many = functools.partial(launch_output, interpret=interpret)

    for li, launch in enumerate(launches):
        shapes = [tuple(s) for s in launch["shapes"]]
        nbytes = sum(o * i for o, i in shapes)
        n = 2 if quick else min(96, max(4, math.ceil(8 * L2_BYTES / nbytes)))
        sets = [make_weights(o, i, n, seed=100 * li + j) for j, (o, i) in enumerate(shapes)]
        ws = tuple(tuple(s[0][k] for s in sets) for k in range(n))  # n sets of the launch's weights
        ss = tuple(tuple(s[1][k] for s in sets) for k in range(n))
        i_dim = shapes[0][1]
        tiled_ws = None  # the weights in the engine's tiles, made once per launch (first "tiled" row)
        fl = None
        if floor:
            row = {"kernel": "read_floor", "case": launch["name"], "launch": launch["name"], "impl": "pallas",
                   "shapes": [list(s) for s in shapes], "bytes": nbytes, "n_weights": n}
            try:
                key = tuple(shapes)
                if key not in floors:
                    configs = read_floor.CONFIGS[:1] if quick else read_floor.CONFIGS
                    if "tiled" in layouts:
                        configs = configs + (read_floor.TILED_CONFIGS[:1] if quick else read_floor.TILED_CONFIGS)
                    floors[key] = read_floor.floor_figures(shapes, n, copy_tb_s, reps=reps, trials=trials,
                                                           interpret=interpret, configs=configs)
                fl = floors[key]
                row.update(fl)
            except Exception as e:  # the launches are still measured without it
                row["error"] = repr(e)[:1000]
            emit(row)
        for m, layout in ((m, layout) for m in decode_ms for layout in layouts):
            x = jax.random.normal(jax.random.key(m), (m, i_dim), jnp.float32).astype(jnp.bfloat16)
            agg_key = m if layout == "checkpoint" else f"{m} {layout}"
            row = {"kernel": "fp8_launch", "case": f"{launch['name']} M={m}" + ("" if layout == "checkpoint" else
                                                                                 f" {layout}"),
                   "launch": launch["name"], "layout": layout,
                   "shapes": [list(s) for s in shapes], "m": m, "impl": "pallas", "count_per_step": launch["count"],
                   "n_weights": n, "bytes": nbytes}
            try:
                if layout == "tiled" and tiled_ws is None:  # outside the timed programs; as the engine, a
                    # weight of no whole number of tiles keeps the checkpoint layout
                    tiled_ws = tuple(tuple(fp8_layout.tile_as_loaded(w) for w in one) for one in ws)
                w_in = tiled_ws if layout == "tiled" else ws
                # the config the launch chooses (reported): its weights' tile rows matter at 33-64 rows
                config = fp8_config.default_config(m, sum(o for o, _ in shapes), i_dim, tile_rows=fm.tile_rows(w_in[0]))
                row["config"] = repr(config)
                prog = loop_program(many, reps, False)
                med, best = timed(prog, x, w_in, ss, trials=trials)
                per = med / (reps * n)
                row.update(s_per_call=per, best_s_per_call=best / (reps * n), tb_s=nbytes / per / 1e12,
                           share_of_copy=nbytes / per / 1e12 / copy_tb_s)
                if device_time:
                    row.update(_device_figures(prog, (x, w_in, ss), reps * n, nbytes, copy_tb_s))
                if fl and "kernel_s_per_call" in fl and "kernel_s_per_call" in row:
                    row.update(floor_share_of_copy=fl["kernel_share_of_copy"],
                               share_of_floor=fl["kernel_s_per_call"] / row["kernel_s_per_call"])
                share = row.get("kernel_share_of_copy", row["share_of_copy"])
                time_key = "kernel_s_per_call" if "kernel_s_per_call" in row else "s_per_call"
                agg = per_step.setdefault(agg_key, {"bytes": 0, "s": 0.0, "by": time_key})
                agg["bytes"] += nbytes * launch["count"]
                agg["s"] += row[time_key] * launch["count"]
                if "busy_s_per_call" in row:  # every kernel of a call: the XLA pieces and split-K sums too
                    agg["busy_s"] = agg.get("busy_s", 0.0) + row["busy_s_per_call"] * launch["count"]
                if share < TARGET_SHARE:
                    miss = {"launch": launch["name"], "share_of_copy": round(share, 3)}
                    if "floor_share_of_copy" in row:
                        miss["floor_share_of_copy"] = round(row["floor_share_of_copy"], 3)
                    below.setdefault(agg_key, []).append(miss)
            except Exception as e:  # record and go on: one failing launch must not hide the others
                row["error"] = repr(e)[:1000]
            emit(row)
    for agg in per_step.values():
        agg["share_of_copy"] = agg["bytes"] / agg["s"] / 1e12 / copy_tb_s
        if "busy_s" in agg:
            agg["busy_share_of_copy"] = agg["bytes"] / agg["busy_s"] / 1e12 / copy_tb_s
    return {"per_step": per_step, "targets": {m: below.get(m, []) for m in per_step}}


def target_lines(result: dict) -> list[str]:
    """The FP8 target (TARGET_SHARE) per row count, met or missed, naming the launches below it."""
    lines = []
    for m, missed in sorted(result["targets"].items(), key=lambda kv: str(kv[0])):
        agg = result["per_step"][m]
        busy = f", {agg['busy_s'] * 1e3:.2f} ms with their XLA pieces and sums" if "busy_s" in agg else ""
        head = (f"FP8 launches at M={m} >= {TARGET_SHARE:.0%} of copy each (by {agg['by']}; all launches of a "
                f"step: {agg['share_of_copy']:.0%}, {agg['s'] * 1e3:.2f} ms{busy})")
        if not missed:
            lines.append(f"target met: {head}")
        else:
            names = ", ".join(f"{x['launch']} {x['share_of_copy']:.0%}"
                              + (f" (read floor {x['floor_share_of_copy']:.0%})" if "floor_share_of_copy" in x else "")
                              for x in missed)
            lines.append(f"target missed: {head}: {names}")
    return lines
