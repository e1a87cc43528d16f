"""Train a small Qwen3.5-architecture model and its MTP head, or only the MTP head of a checkpoint.

    python -m qmtp.train --flagfile=configs/train_demo.flags            # target + MTP, jointly
    python -m qmtp.train --train_mtp_only --init_checkpoint=DIR --out_dir=RUN [--mtp_data=self_distill]

Objective: L_main + lambda * L_mtp (qmtp.train.loss); --train_mtp_only freezes the target and trains
only the mtp.* tensors. AdamW after global-norm clipping, warm-up then cosine decay; float32 masters,
forward in --compute_dtype. Data: qmtp.train.data.

The run directory (--out_dir):
    config.json          the model's config (joint runs)        run_config.json   the flags
    data/                tokenizer.json, train.npy, eval.npy, meta.json (built once, reused on --resume)
    checkpoints/<step>/  orbax: {"params": trained tree, "opt_state": optax state, "step"}
    best/                --export_best: the parameters of the lowest held-out loss, best.json
    metrics.jsonl        one row per log / eval step        loss.png   target and MTP loss curves
    export/              the HF-format checkpoint (qmtp.train.export), written when the run reaches --steps
    summary.json         parameter count, export size, final losses, held-out MTP acceptance, timings,
                         and "degenerate": why the model is degenerate (qmtp.train.health), or null

Every held-out evaluation also checks the model for collapse (qmtp.train.health: no better than the
held-out token frequencies, or one greedy token almost everywhere). A degenerate model's MTP acceptance
is trivially high (a target that always emits one token agrees with its own MTP head): the report then
says DEGENERATE MODEL and marks the acceptance as not meaningful.

--resume continues bit for bit (the batch of step s is a function of (--seed, s); the optimizer state
is restored); --stop_at_step ends a run early after checkpointing.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qmtp import api, cli_help
from qmtp.model import checkpoint, config as qconfig, mtp
from qmtp.tools import presets, tiny_tokenizer
from qmtp.tools.make_checkpoint import parse_size
from qmtp.train import data as train_data, export, health, loss as train_loss
from qmtp.train.checkpoints import Best, CKPT_DIR, DATA_DIR, manager, restore
from qmtp.train.flags import cli, define_flags, RESUME_FREE
from qmtp.train.hyper import float_tree, Hyper


def _losses(cfg, hp: Hyper, trainable, frozen, tokens, mtp_mask, predictions: bool = False):
    """The objective of the full tree in the compute dtype: trainable (all, or {"mtp": ...}) over frozen."""
    params = train_loss.cast_for_compute(dict(frozen, **trainable), jnp.dtype(hp.compute_dtype))
    return train_loss.losses(cfg, params, tokens, mtp_mask, mtp_weight=hp.mtp_loss_weight, mtp_only=hp.mtp_only,
                             mtp_depth=hp.mtp_depth, predictions=predictions)


@functools.partial(jax.jit, static_argnames=("cfg", "hp"), donate_argnames=("trainable", "opt_state"))
def train_step(cfg, hp: Hyper, trainable, frozen, opt_state, tokens, mtp_mask):
    """One AdamW step on tokens [B, T]; returns (trainable', opt_state', metrics)."""
    grads, metrics = jax.grad(lambda tr: _losses(cfg, hp, tr, frozen, tokens, mtp_mask), has_aux=True)(trainable)
    updates, opt_state = hp.optimizer().update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnames=("cfg", "hp"))
def eval_step(cfg, hp: Hyper, trainable, frozen, tokens):
    """The losses of held-out tokens [B, T] and the target's greedy predictions [B, T-1]."""
    return _losses(cfg, hp, trainable, frozen, tokens, None, predictions=True)[1]


def _log(msg: str) -> None:
    print(f"train: {msg}", file=sys.stderr, flush=True)


def _show_progress(step: int, total: int, start: int, t0: float, m: dict, tok_s: float) -> None:
    """One stderr line: step, losses, MTP acceptance, tokens/s, elapsed and ETA (a redrawn line on a tty)."""
    def _fmt_time(s: float) -> str:
        s = int(max(s, 0))
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    elapsed = time.monotonic() - t0
    eta = elapsed / max(step - start, 1) * (total - step)
    line = (f"step {step:>{len(str(total))}}/{total} {100 * step / total:5.1f}% | loss {m['loss']:.4f} "
            f"(main {m['main']:.4f}, mtp {m['mtp']:.4f}) | accept {m['accept']:.3f} | "
            f"{f'{tok_s:,.0f}' if tok_s else '-'} tok/s | {_fmt_time(elapsed)} elapsed, ETA {_fmt_time(eta)}")
    tty = sys.stderr.isatty()
    print(("\r" + line + "\033[K") if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)


def _plot_curves(rows: list[dict], path: str) -> None:
    """Target and MTP loss (train and held-out) and held-out MTP acceptance against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, style in (("train", "-"), ("eval", "o--")):
        r = [x for x in rows if x["kind"] == kind]
        if not r:
            continue
        steps = [x["step"] for x in r]
        for key, label, color in (("main", "target (next token)", "C0"), ("mtp", "MTP (token after next)", "C1")):
            ax.plot(steps, [x[key] for x in r], style, label=f"{label}, {kind}", color=color,
                    alpha=0.8 if kind == "train" else 1.0)
        ax2.plot(steps, [x["accept"] for x in r], style, label=kind, color="C2" if kind == "eval" else "C7")
    ref = [x for x in rows if x["kind"] == "eval" and "unigram" in x]
    if ref:  # below this line the target has learned more than token frequencies (qmtp.train.health)
        ax.plot([x["step"] for x in ref], [x["unigram"] for x in ref], ":", color="k", alpha=0.6,
                label="held-out token frequencies (unigram)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="losses")
    ax2.set(xlabel="step", ylabel="share", title="teacher-forced first-draft acceptance", ylim=(0, 1))
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _model_config(f: dict) -> dict:
    """config.json of the model of the flags `f`: qmtp.tools.make_checkpoint's Qwen3.5 layout; the
    tokenizer's specials are its last three ids (qmtp.train.data)."""
    text = presets.text_config(
        hidden=f["hidden_size"], ffn=f["intermediate_size"], num_layers=f["num_layers"],
        interval=f["full_attention_interval"], heads=f["num_attention_heads"], kv_heads=f["num_key_value_heads"],
        head_dim=f["head_dim"], partial_rotary=f["partial_rotary_factor"], rope_theta=f["rope_theta"],
        gdn_k_heads=f["linear_num_key_heads"], gdn_v_heads=f["linear_num_value_heads"],
        gdn_k_dim=f["linear_key_head_dim"], gdn_v_dim=f["linear_value_head_dim"], conv=f["linear_conv_kernel_dim"],
        vocab=f["vocab_size"], tie=f["tie_word_embeddings"], max_positions=f["max_position_embeddings"])
    eot = tiny_tokenizer.bos_token_id(f["vocab_size"])
    text.update(bos_token_id=eot, eos_token_id=eot, dtype="float32" if f["export_dtype"] == "fp32" else "bfloat16")
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": f["tie_word_embeddings"], "dtype": text["dtype"], "text_config": text,
            "qmtp_trained": {"seed": f["seed"], "steps": f["steps"], "generator": "qmtp.train"}}


def _setup(fv, flag_dict: dict) -> tuple:
    """(cfg, the config.json dict of a joint run (written) or None, trainable tree, frozen tree, train_data.Data)."""
    tokenizer = None
    if fv.train_mtp_only:
        cfg, params = checkpoint.load(fv.init_checkpoint, dtype=fv.compute_dtype, progress=False)
        mtp.check_supported(cfg)
        tokenizer = api._load_tokenizer(fv.init_checkpoint)
        if tokenizer is None:
            raise ValueError(f"{fv.init_checkpoint} has no tokenizer.json: MTP training needs its tokenizer")
        if tokenizer.get_vocab_size() > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids > vocab_size {cfg.vocab_size}")
        config, trainable = None, {"mtp": float_tree(params["mtp"])}
        frozen = {k: v for k, v in params.items() if k != "mtp"}
    else:
        config = _model_config(flag_dict)
        cfg = qconfig.from_dict(config, source="train flags")
        with open(os.path.join(fv.out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        trainable = jax.tree_util.tree_map(jnp.asarray, train_loss.init_params(cfg, fv.seed, fv.init_std))
        frozen = {}
    data = train_data.prepare(os.path.join(fv.out_dir, DATA_DIR), vocab_size=fv.vocab_size, tokenizer=tokenizer,
                              corpus_dir=fv.corpus_dir or None, eval_fraction=fv.eval_fraction,
                              max_bytes=fv.corpus_max_bytes, include_tests=fv.corpus_include_tests,
                              tokenizer_max_bytes=fv.tokenizer_max_bytes, log=_log)
    return cfg, config, trainable, frozen, data


def _batches(fv, cfg, params: dict, data: train_data.Data):
    """(batch(step) -> (tokens [B, T], mtp_mask [B, T-2] | None), fixed eval batches). --mtp_data=self_distill:
    corpus prompts of --self_distill_prompt_len tokens + the target's greedy continuation (the MTP labels)."""
    b, t, p = fv.batch_size, fv.seq_len, fv.self_distill_prompt_len
    if fv.mtp_data == "self_distill":
        model = api.Model(cfg, params, data.tokenizer, fv.init_checkpoint, dtype=fv.compute_dtype)
        n, pool, t0 = fv.self_distill_sequences, [], time.monotonic()
        starts = np.random.default_rng([fv.seed, 1 << 30]).integers(0, data.train.size - p, n)
        for lo in range(0, n, b):
            prompts = [data.train[s:s + p].astype(np.int32).tolist() for s in starts[lo:lo + b]]
            res = api.generate(model, prompts, max_new_tokens=t - p, stop_token_ids=())
            pool += [pr + new for pr, new in zip(prompts, res.tokens)]
        _log(f"self-distillation: {n} greedy continuations of {t - p} tokens in {time.monotonic() - t0:.1f} s")
        pool = np.asarray(pool, np.int32)
        mask = jnp.asarray(np.broadcast_to(np.arange(t - 2)[None] + 2 >= p, (b, t - 2)).astype(np.float32))
        batch = lambda step: (pool[np.random.default_rng([fv.seed, step]).integers(0, len(pool), b)], mask)
    else:
        batch = lambda step: (train_data.train_batch(data.train, step, fv.seed, b, t), None)
    windows = train_data.eval_windows(data.eval, fv.eval_batches * b, t)
    return batch, [windows[i:i + b] for i in range(0, len(windows), b)]


def _check_run_dir(fv, flag_dict: dict) -> None:
    """Refuses a fresh run over a run and a --resume with other flags; writes run_config.json."""
    out, path = fv.out_dir, os.path.join(fv.out_dir, "run_config.json")
    os.makedirs(out, exist_ok=True)
    ckpt_dir = os.path.join(out, CKPT_DIR)
    if not fv.resume and os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir)):
        raise ValueError(f"{out} already holds a run; pass --resume to continue it, or choose a new --out_dir")
    if fv.resume and os.path.isfile(path):
        with open(path) as f:
            before = json.load(f)
        diff = sorted(k for k in flag_dict if k not in RESUME_FREE and before.get(k) != flag_dict[k])
        if diff:
            raise ValueError(f"--resume with different flags than the run: {', '.join(diff)}")
    with open(path, "w") as f:
        json.dump(flag_dict, f, indent=2, sort_keys=True)


def run(fv) -> dict:
    """The whole run for parsed flags; returns the summary dict."""
    cli_help.check_output_dir("out_dir", fv.out_dir)  # before anything is read, built or written
    cli_help.check_output_dir("export_dir", fv.export_dir)
    if fv.train_mtp_only and not fv.init_checkpoint:
        raise ValueError("--train_mtp_only needs --init_checkpoint")
    if fv.seq_len < fv.mtp_depth + 2:
        raise ValueError(f"--seq_len={fv.seq_len}: --mtp_depth={fv.mtp_depth} needs at least {fv.mtp_depth + 2} tokens")
    if not fv.train_mtp_only and fv.mtp_data != "corpus":
        raise ValueError("--mtp_data=self_distill needs --train_mtp_only (the target must be trained first)")
    if fv.mtp_data == "self_distill" and fv.self_distill_prompt_len >= fv.seq_len - 1:
        raise ValueError(f"--self_distill_prompt_len={fv.self_distill_prompt_len} must be < --seq_len - 1 = "
                         f"{fv.seq_len - 1}")
    out, flag_dict = fv.out_dir, {name: fv[name].value for name in sorted(fv)}
    _check_run_dir(fv, flag_dict)
    t_start = time.monotonic()
    cfg, config, trainable, frozen, data = _setup(fv, flag_dict)
    hp = Hyper(fv.steps, fv.learning_rate, fv.warmup_steps, fv.min_lr_ratio, fv.weight_decay, fv.grad_clip,
               fv.adam_b1, fv.adam_b2, fv.mtp_loss_weight, fv.compute_dtype, fv.train_mtp_only, fv.mtp_depth)
    n_params = train_loss.param_count(trainable)
    _log(f"model: {cfg.num_hidden_layers} layers {list(cfg.layer_types)}, E {cfg.hidden_size}, V {cfg.vocab_size}; "
         f"{n_params:,} trained parameters ({'MTP head only' if hp.mtp_only else 'target + MTP'})")

    batch, evals = _batches(fv, cfg, dict(frozen, **trainable), data)
    opt_state, step = hp.optimizer().init(trainable), 0
    ocp, mngr = manager(out, fv.keep_checkpoints)
    if fv.resume and mngr.latest_step() is not None:
        got = restore(out, {"params": trainable, "opt_state": opt_state, "step": jnp.int32(0)})
        trainable, opt_state, step = got["params"], got["opt_state"], int(got["step"])
        _log(f"resumed from step {step}")
    best = Best(out, trainable, fv.resume) if fv.export_best else None
    metrics_path = os.path.join(out, "metrics.jsonl")
    rows = []
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            rows = [r for r in (json.loads(line) for line in f if line.strip()) if r["step"] <= step]
    with open(metrics_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)

    def record(row):
        rows.append(row)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if best is not None and row["kind"] == "eval":
            best.offer(row, trainable)

    eval_labels = np.concatenate(evals)[:, 1:]

    def evaluate(step):
        ms = [jax.device_get(eval_step(cfg, hp, trainable, frozen, jnp.asarray(x))) for x in evals]
        predictions = np.concatenate([m.pop("predictions") for m in ms])
        row = dict(step=step, kind="eval", **{k: float(np.mean([m[k] for m in ms])) for k in ms[0]})
        check = health.check(row["main"], eval_labels, predictions, data.eval, data.tokenizer)
        row.update({k: check[k] for k in ("unigram", "top_token", "top_share", "degenerate")})
        record(row)

    if step == 0:
        evaluate(0)
    end = min(fv.steps, fv.stop_at_step or fv.steps)
    schedule, first, compile_s = hp.schedule(), step, 0.0
    window, timed, t_train = [], 0, time.monotonic()
    p_start, p_t0, t_win = step, t_train, t_train
    while step < end:
        tokens, mask = batch(step)
        trainable, opt_state, m = train_step(cfg, hp, trainable, frozen, opt_state, jnp.asarray(tokens), mask)
        step += 1
        window.append(m)
        timed += 1
        if step == first + 1:  # the first step compiles: time the rest
            jax.block_until_ready(m)
            compile_s = time.monotonic() - t_train
            _log(f"first step (compile + run) {compile_s:.1f} s")
            p_start, p_t0, t_win, timed = step, time.monotonic(), time.monotonic(), 0  # progress: from here
        if step % fv.log_every == 0 or step == end:
            m = {k: float(np.mean([x[k] for x in jax.device_get(window)])) for k in window[0]}
            now = time.monotonic()
            tok_s = timed * fv.batch_size * fv.seq_len / max(now - t_win, 1e-9)
            _show_progress(step, end, p_start, p_t0, m, tok_s)
            record(dict(step=step, kind="train", tok_s=tok_s, lr=float(schedule(step - 1)), **m))
            window, timed, t_win = [], 0, now
        t_pause = time.monotonic()  # evaluation and checkpointing do not count in tok/s
        if (fv.eval_every and step % fv.eval_every == 0) or step == fv.steps:
            evaluate(step)
        if step % fv.checkpoint_every == 0 or step == end:
            mngr.save(step, args=ocp.args.StandardSave({"params": trainable, "opt_state": opt_state,
                                                        "step": jnp.int32(step)}))
        t_win += time.monotonic() - t_pause
    if sys.stderr.isatty():
        print(file=sys.stderr, flush=True)
    mngr.wait_until_finished()
    mngr.close()
    if best is not None:
        best.close()
    train_s = time.monotonic() - t_train
    steady = [r["tok_s"] for r in rows if r["kind"] == "train" and r["step"] > first + 1 and r["tok_s"] > 0]
    _plot_curves(rows, os.path.join(out, "loss.png"))

    evals_done = [r for r in rows if r["kind"] == "eval"]
    summary = {"step": step, "steps": fv.steps, "trained_parameters": n_params,
               "total_parameters": train_loss.param_count(dict(frozen, **trainable)),
               "train_seconds_this_process": train_s, "first_step_seconds": compile_s,
               "median_tokens_per_s": float(np.median(steady)) if steady else None,
               "wall_seconds_this_process": time.monotonic() - t_start,
               "data": data.meta, "last_train": next((r for r in reversed(rows) if r["kind"] == "train"), None),
               "first_eval": evals_done[0] if evals_done else None, "last_eval": evals_done[-1] if evals_done else None,
               "device": str(jax.devices()[0])}
    if step == fv.steps:
        export_dir, chosen, exported_step = fv.export_dir or os.path.join(out, "export"), trainable, step
        if best is not None and best.step is not None:
            chosen, exported_step = best.params, best.step
            _log(f"exporting the parameters of step {best.step} (lowest held-out loss {best.loss:.4f})")
        host = jax.device_get(chosen)
        if config is None:  # MTP only: the new head written back into a copy of the checkpoint
            path = export.write_back_mtp(fv.init_checkpoint, export_dir, cfg, host["mtp"], overwrite=True)
        else:
            path = export.export_checkpoint(export_dir, config, host, data.tokenizer, fv.export_dtype,
                                            parse_size(fv.export_max_shard_bytes), overwrite=True)
        files = {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))}
        summary["export"] = {"dir": path, "bytes": sum(files.values()), "step": exported_step, "files": files}
        _log(f"exported {path} ({summary['export']['bytes'] / 1e6:.1f} MB)")
        if fv.final_eval_windows:
            model = api.load(path, dtype=fv.compute_dtype, progress=False)
            win = train_data.eval_windows(data.eval, fv.final_eval_windows, fv.seq_len)
            acceptance = float(np.mean([api.mtp_logits(model, w.tolist()).agreement for w in win]))
            check = summary["heldout_check"] = _export_check(model, win, data)
            summary["heldout_mtp_acceptance"] = {"windows": len(win), "tokens_per_window": fv.seq_len,
                                                 "acceptance": acceptance, "dtype": fv.compute_dtype,
                                                 "meaningful": not check["degenerate"]}
            if check["degenerate"]:
                _log(health.describe(check, acceptance))
            else:
                _log(f"held-out teacher-forced MTP acceptance (qmtp.mtp_logits on the export): {acceptance:.3f} "
                     f"({health.describe(check)})")
    if "heldout_check" in summary:  # the verdict on the export
        summary["degenerate"] = summary["heldout_check"]["degenerate"]
    else:  # no final acceptance: the verdict of the evaluation of the exported (or last) parameters
        exported = summary.get("export", {}).get("step", step)
        row = next((r for r in reversed(evals_done) if r["step"] == exported), evals_done[-1] if evals_done else {})
        summary["degenerate"] = row.get("degenerate")
        if summary["degenerate"]:
            _log(f"{health.describe(row, row['accept'])} (held-out evaluation of step {row['step']})")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def _export_check(model: api.Model, windows: np.ndarray, data: train_data.Data) -> dict:
    """health.check of a loaded checkpoint's target (qmtp.target_logits) over held-out windows [N, T]."""
    losses, predictions = [], []
    for w in windows:
        logits = api.target_logits(model, w.tolist())[:-1].astype(np.float64)  # [T-1, V]: predicts w[1:]
        top = logits.max(-1)
        log_z = top + np.log(np.exp(logits - top[:, None]).sum(-1))
        losses.append(log_z - logits[np.arange(len(w) - 1), w[1:]])
        predictions.append(logits.argmax(-1))
    return health.check(float(np.mean(np.concatenate(losses))), windows[:, 1:], np.concatenate(predictions),
                        data.eval, data.tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad flags or input)."""
    def body(fv) -> str:
        if not fv.out_dir:
            raise ValueError("--out_dir is required")
        summary = run(fv)
        printed = {k: summary[k] for k in ("step", "trained_parameters", "last_eval") if k in summary}
        if summary["degenerate"]:  # the acceptance of a collapsed model is no result (qmtp.train.health)
            printed["degenerate"] = health.describe(summary)
            if printed.get("last_eval"):
                printed["last_eval"] = {k: v for k, v in printed["last_eval"].items() if k != "accept"}
        return json.dumps(printed | ({"export": summary["export"]["dir"]} if "export" in summary else {}))
    usage = f"usage: python -m qmtp.train --out_dir=RUN [flags]   (or --flagfile=configs/train_demo.flags)\n\n{__doc__}"
    return cli(argv, define_flags, usage, "train", body)
