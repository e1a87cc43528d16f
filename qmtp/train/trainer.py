"""Train a small Qwen3.5-architecture model and its MTP head, or only the MTP head of a checkpoint.

    python -m qmtp.train --flagfile=configs/train_demo.flags            # target + MTP, jointly
    python -m qmtp.train --train_mtp_only --init_checkpoint=DIR --out_dir=RUN [--mtp_data=self_distill]
    python -m qmtp.train --help

Objective (qmtp.train.loss): next-token cross-entropy of the target plus lambda (--mtp_loss_weight,
DeepSeek-V3's 0.3) times the cross-entropy of the MTP head, which at position p reads the target's
post-final-norm hidden h_p and the embedding of x_{p+1} and predicts x_{p+2} (qmtp.model.mtp.forward, as
inference runs it). With --train_mtp_only the target is frozen (loaded by qmtp.model.checkpoint.load, FP8
weights kept FP8) and only the mtp.* tensors train, on corpus windows or on the target's own greedy
continuations of corpus prompts (--mtp_data=self_distill: the MTP loss covers only the generated
tokens). Optimizer: AdamW (decay on >= 2-D weights) after global-norm clipping, linear warm-up and
cosine decay to --min_lr_ratio; float32 master weights, forward in --compute_dtype.

Data (qmtp.train.data): the interpreter's standard-library *.py files (or --corpus_dir), a
deterministic held-out subset for evaluation, a byte-level BPE tokenizer trained on the rest.

The run directory (--out_dir):
    config.json          the model's config (joint runs)        run_config.json   the flags
    data/                tokenizer.json, train.npy, eval.npy, meta.json (built once, reused on --resume)
    checkpoints/<step>/  orbax: {"params": trained tree, "opt_state": optax state, "step"}
    metrics.jsonl        one row per log / eval step        loss.png   target and MTP loss curves
    export/              the HF-format checkpoint (qmtp.train.export), written when the run reaches --steps
    summary.json         parameter count, export size, final losses, held-out MTP acceptance, timings

--resume continues from the latest checkpoint exactly: the batch of step s is a function of
(--seed, s) and the optimizer state is restored, so the parameters equal those of an uninterrupted
run bit for bit (same machine and JAX). --stop_at_step ends a run early after checkpointing (for
jobs with a time limit; resume later).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Sequence

from absl import flags

import jax
import jax.numpy as jnp
import numpy as np
import optax

from qmtp.train import data as train_data, loss as train_loss
from qmtp.train.checkpoints import Best, CKPT_DIR, DATA_DIR, manager, restore
from qmtp.train.flags import define_flags, RESUME_FREE
from qmtp.train.hyper import float_tree, Hyper
from qmtp.train.report import plot_curves, Progress, read_metrics

def _merged(hp: Hyper, trainable: dict, frozen: dict) -> dict:
    """The full parameter tree in the compute dtype: trainable (all, or {"mtp": ...}) over frozen."""
    return train_loss.cast_for_compute(dict(frozen, **trainable), jnp.dtype(hp.compute_dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "hp"), donate_argnames=("trainable", "opt_state"))
def train_step(cfg, hp: Hyper, trainable, frozen, opt_state, tokens, mtp_mask):
    """One AdamW step on tokens [B, T]; returns (trainable', opt_state', metrics)."""
    def loss_fn(tr):
        return train_loss.losses(cfg, _merged(hp, tr, frozen), tokens, mtp_mask, mtp_weight=hp.mtp_loss_weight,
                                 mtp_only=hp.mtp_only, mtp_depth=hp.mtp_depth)
    grads, metrics = jax.grad(loss_fn, has_aux=True)(trainable)
    updates, opt_state = hp.optimizer().update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnames=("cfg", "hp"))
def eval_step(cfg, hp: Hyper, trainable, frozen, tokens, mtp_mask):
    return train_loss.losses(cfg, _merged(hp, trainable, frozen), tokens, mtp_mask, mtp_weight=hp.mtp_loss_weight,
                             mtp_only=hp.mtp_only, mtp_depth=hp.mtp_depth)[1]


# ---- the run ------------------------------------------------------------------------------------------

def _log(msg: str) -> None:
    print(f"train: {msg}", file=sys.stderr, flush=True)


def _model_config(fv) -> dict:
    from qmtp.train import export
    return export.model_config(
        hidden_size=fv.hidden_size, intermediate_size=fv.intermediate_size, num_layers=fv.num_layers,
        full_attention_interval=fv.full_attention_interval, num_attention_heads=fv.num_attention_heads,
        num_key_value_heads=fv.num_key_value_heads, head_dim=fv.head_dim,
        partial_rotary_factor=fv.partial_rotary_factor, rope_theta=fv.rope_theta,
        linear_num_key_heads=fv.linear_num_key_heads, linear_num_value_heads=fv.linear_num_value_heads,
        linear_key_head_dim=fv.linear_key_head_dim, linear_value_head_dim=fv.linear_value_head_dim,
        linear_conv_kernel_dim=fv.linear_conv_kernel_dim, vocab_size=fv.vocab_size,
        tie_word_embeddings=fv.tie_word_embeddings, max_position_embeddings=fv.max_position_embeddings,
        dtype=fv.export_dtype, note={"seed": fv.seed, "steps": fv.steps})


def _flag_dict(fv) -> dict:
    return {name: fv[name].value for name in sorted(fv) if name in _OWN_FLAGS}


@dataclasses.dataclass
class Setup:
    cfg: object
    config: dict | None  # config.json dict of a joint run
    trainable: dict
    frozen: dict
    data: train_data.Data


def _setup(fv, log) -> Setup:
    from qmtp.model import config as qconfig
    data_dir = os.path.join(fv.out_dir, DATA_DIR)
    corpus = dict(corpus_dir=fv.corpus_dir or None, eval_fraction=fv.eval_fraction, max_bytes=fv.corpus_max_bytes,
                  include_tests=fv.corpus_include_tests, tokenizer_max_bytes=fv.tokenizer_max_bytes, log=log)
    if fv.train_mtp_only:
        from qmtp import api
        from qmtp.model import checkpoint, mtp
        cfg, params = checkpoint.load(fv.init_checkpoint, dtype=fv.compute_dtype, progress=False)
        mtp.check_supported(cfg)
        tokenizer = api._load_tokenizer(fv.init_checkpoint)
        if tokenizer is None:
            raise ValueError(f"{fv.init_checkpoint} has no tokenizer.json: MTP training needs its tokenizer")
        if tokenizer.get_vocab_size() > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids > vocab_size {cfg.vocab_size}")
        data = train_data.prepare(data_dir, vocab_size=None, tokenizer=tokenizer, **corpus)
        frozen = {k: v for k, v in params.items() if k != "mtp"}
        return Setup(cfg, None, {"mtp": float_tree(params["mtp"])}, frozen, data)
    config = _model_config(fv)
    cfg = qconfig.from_dict(config, source="train flags")
    data = train_data.prepare(data_dir, vocab_size=fv.vocab_size, **corpus)
    trainable = jax.tree_util.tree_map(jnp.asarray, train_loss.init_params(cfg, fv.seed, fv.init_std))
    return Setup(cfg, config, trainable, {}, data)


def _self_distill_pool(fv, setup: Setup, log) -> np.ndarray:
    """[N, T] int32: corpus prompts (--self_distill_prompt_len) + the target's greedy continuation."""
    from qmtp import api
    p, t = fv.self_distill_prompt_len, fv.seq_len
    if p >= t - 1:
        raise ValueError(f"--self_distill_prompt_len={p} must be < --seq_len - 1 = {t - 1}")
    params = dict(setup.frozen, mtp=setup.trainable["mtp"])
    model = api.Model(setup.cfg, params, setup.data.tokenizer, fv.init_checkpoint, dtype=fv.compute_dtype)
    stream, n = setup.data.train, fv.self_distill_sequences
    starts = np.random.default_rng([fv.seed, 1 << 30]).integers(0, stream.size - p, n)
    rows, t0 = [], time.monotonic()
    for lo in range(0, n, fv.batch_size):
        prompts = [stream[s:s + p].astype(np.int32).tolist() for s in starts[lo:lo + fv.batch_size]]
        res = api.generate(model, prompts, max_new_tokens=t - p, stop_token_ids=())
        rows += [pr + new for pr, new in zip(prompts, res.tokens)]
    log(f"self-distillation: {n} greedy continuations of {t - p} tokens in {time.monotonic() - t0:.1f} s")
    return np.asarray(rows, np.int32)


def _batches(fv, setup: Setup, pool):
    """(batch(step) -> (tokens [B, T], mtp_mask [B, T-2] | None), fixed eval batches)."""
    b, t = fv.batch_size, fv.seq_len
    if pool is None:
        batch = lambda step: (train_data.train_batch(setup.data.train, step, fv.seed, b, t), None)
    else:
        mask = np.broadcast_to(np.arange(t - 2)[None] + 2 >= fv.self_distill_prompt_len, (b, t - 2))
        mask = jnp.asarray(mask.astype(np.float32))  # label x_{p+2} generated by the target
        batch = lambda step: (pool[np.random.default_rng([fv.seed, step]).integers(0, len(pool), b)], mask)
    windows = train_data.eval_windows(setup.data.eval, fv.eval_batches * b, t)
    evals = [windows[i:i + b] for i in range(0, len(windows), b)]
    return batch, evals


def _evaluate(cfg, hp, setup, trainable, evals) -> dict:
    ms = [jax.device_get(eval_step(cfg, hp, trainable, setup.frozen, jnp.asarray(x), None)) for x in evals]
    return {k: float(np.mean([m[k] for m in ms])) for k in ms[0]}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def heldout_acceptance(checkpoint_dir: str, stream: np.ndarray, windows: int, seq_len: int, dtype: str) -> dict:
    """qmtp.load (strict) of a written checkpoint, then qmtp.mtp_logits' teacher-forced first-draft
    acceptance over held-out windows (the issue's measure)."""
    from qmtp import api
    model = api.load(checkpoint_dir, dtype=dtype, progress=False)
    win = train_data.eval_windows(stream, windows, seq_len)
    agree = [api.mtp_logits(model, w.tolist()).agreement for w in win]
    return {"windows": len(win), "tokens_per_window": seq_len, "acceptance": float(np.mean(agree)),
            "dtype": dtype}


def run(fv) -> dict:
    """The whole run for parsed flags; returns the summary dict."""
    out = fv.out_dir
    if fv.train_mtp_only and not fv.init_checkpoint:
        raise ValueError("--train_mtp_only needs --init_checkpoint")
    if fv.seq_len < fv.mtp_depth + 2:
        raise ValueError(f"--seq_len={fv.seq_len}: --mtp_depth={fv.mtp_depth} needs at least {fv.mtp_depth + 2} tokens")
    if not fv.train_mtp_only and fv.mtp_data != "corpus":
        raise ValueError("--mtp_data=self_distill needs --train_mtp_only (the target must be trained first)")
    os.makedirs(out, exist_ok=True)
    run_cfg_path = os.path.join(out, "run_config.json")
    flags_now = _flag_dict(fv)
    has_ckpt = os.path.isdir(os.path.join(out, CKPT_DIR)) and any(
        n.isdigit() for n in os.listdir(os.path.join(out, CKPT_DIR)))
    if has_ckpt and not fv.resume:
        raise ValueError(f"{out} already holds a run; pass --resume to continue it, or choose a new --out_dir")
    if fv.resume and os.path.isfile(run_cfg_path):
        with open(run_cfg_path) as f:
            before = json.load(f)
        diff = sorted(k for k in flags_now if k not in RESUME_FREE and before.get(k) != flags_now[k])
        if diff:
            raise ValueError(f"--resume with different flags than the run: {', '.join(diff)}")
    with open(run_cfg_path, "w") as f:
        json.dump(flags_now, f, indent=2, sort_keys=True)

    t_start = time.monotonic()
    setup = _setup(fv, _log)
    cfg = setup.cfg
    if setup.config is not None:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(setup.config, f, indent=2, sort_keys=True)
    hp = Hyper(fv.steps, fv.learning_rate, fv.warmup_steps, fv.min_lr_ratio, fv.weight_decay, fv.grad_clip,
               fv.adam_b1, fv.adam_b2, fv.mtp_loss_weight, fv.compute_dtype, fv.train_mtp_only, fv.mtp_depth)
    n_params = train_loss.param_count(setup.trainable)
    _log(f"model: {cfg.num_hidden_layers} layers {list(cfg.layer_types)}, E {cfg.hidden_size}, V {cfg.vocab_size}; "
         f"{n_params:,} trained parameters ({'MTP head only' if hp.mtp_only else 'target + MTP'})")

    trainable, opt_state, step = setup.trainable, hp.optimizer().init(setup.trainable), 0
    ocp, mngr = manager(out, fv.keep_checkpoints)
    if fv.resume and mngr.latest_step() is not None:
        got = restore(out, {"params": trainable, "opt_state": opt_state, "step": jnp.int32(0)})
        trainable, opt_state, step = got["params"], got["opt_state"], int(got["step"])
        _log(f"resumed from step {step}")
    best = Best(out, trainable, fv.resume) if fv.export_best else None
    pool = _self_distill_pool(fv, setup, _log) if fv.mtp_data == "self_distill" else None
    batch, evals = _batches(fv, setup, pool)
    metrics_path = os.path.join(out, "metrics.jsonl")
    rows = read_metrics(metrics_path, step)
    with open(metrics_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)

    def record(row):
        rows.append(row)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if best is not None and row["kind"] == "eval":
            best.offer(row, trainable)

    if step == 0:
        record(dict(step=0, kind="eval", **_evaluate(cfg, hp, setup, trainable, evals)))
    end = min(fv.steps, fv.stop_at_step or fv.steps)
    tokens_per_step, schedule, first = fv.batch_size * fv.seq_len, hp.schedule(), step
    progress, window, timed, t_win = Progress(end, step), [], 0, time.monotonic()
    compile_s, t_train = 0.0, time.monotonic()
    while step < end:
        tokens, mask = batch(step)
        trainable, opt_state, m = train_step(cfg, hp, trainable, setup.frozen, opt_state, jnp.asarray(tokens), mask)
        step += 1
        window.append(m)
        timed += 1
        if step == first + 1:  # the first step compiles: time the rest
            jax.block_until_ready(m)
            compile_s = time.monotonic() - t_train
            _log(f"first step (compile + run) {compile_s:.1f} s")
            progress.start, progress.t0, t_win, timed = step, time.monotonic(), time.monotonic(), 0
        if step % fv.log_every == 0 or step == end:
            m = {k: float(np.mean([x[k] for x in jax.device_get(window)])) for k in window[0]}
            now = time.monotonic()
            tok_s = timed * tokens_per_step / max(now - t_win, 1e-9)
            progress.show(step, m, tok_s)
            record(dict(step=step, kind="train", tok_s=tok_s, lr=float(schedule(step - 1)), **m))
            window, timed, t_win = [], 0, now
        t_pause = time.monotonic()  # evaluation and checkpointing do not count in tok/s
        if (fv.eval_every and step % fv.eval_every == 0) or step == fv.steps:
            record(dict(step=step, kind="eval", **_evaluate(cfg, hp, setup, trainable, evals)))
        if step % fv.checkpoint_every == 0 or step == end:
            mngr.save(step, args=ocp.args.StandardSave({"params": trainable, "opt_state": opt_state,
                                                        "step": jnp.int32(step)}))
        t_win += time.monotonic() - t_pause
    progress.newline()
    mngr.wait_until_finished()
    mngr.close()
    if best is not None:
        best.close()
    train_s = time.monotonic() - t_train
    steady = [r["tok_s"] for r in rows if r["kind"] == "train" and r["step"] > first + 1 and r["tok_s"] > 0]
    plot_curves(rows, os.path.join(out, "loss.png"))

    summary = {"step": step, "steps": fv.steps, "trained_parameters": n_params,
               "total_parameters": train_loss.param_count(dict(setup.frozen, **trainable)),
               "train_seconds_this_process": train_s, "first_step_seconds": compile_s,
               "median_tokens_per_s": float(np.median(steady)) if steady else None,
               "wall_seconds_this_process": time.monotonic() - t_start,
               "data": setup.data.meta, "last_train": next((r for r in reversed(rows) if r["kind"] == "train"), None),
               "first_eval": next((r for r in rows if r["kind"] == "eval"), None),
               "last_eval": next((r for r in reversed(rows) if r["kind"] == "eval"), None),
               "device": str(jax.devices()[0])}
    if step == fv.steps:
        export_dir = fv.export_dir or os.path.join(out, "export")
        from qmtp.tools.make_checkpoint import parse_size
        chosen, exported_step = trainable, step
        if best is not None and best.step is not None:
            chosen, exported_step = best.params, best.step
            _log(f"exporting the parameters of step {best.step} (lowest held-out loss {best.loss:.4f})")
        path = _export(setup, chosen, export_dir, fv.export_dtype, parse_size(fv.export_max_shard_bytes), fv)
        summary["export"] = {"dir": path, "bytes": _dir_bytes(path), "step": exported_step,
                             "files": {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))}}
        _log(f"exported {path} ({summary['export']['bytes'] / 1e6:.1f} MB)")
        if fv.final_eval_windows:
            summary["heldout_mtp_acceptance"] = heldout_acceptance(
                path, setup.data.eval, fv.final_eval_windows, fv.seq_len, fv.compute_dtype)
            _log(f"held-out teacher-forced MTP acceptance (qmtp.mtp_logits on the export): "
                 f"{summary['heldout_mtp_acceptance']['acceptance']:.3f}")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def _export(setup: Setup, trainable: dict, export_dir: str, dtype: str, max_shard_bytes: int, fv) -> str:
    from qmtp.train import export
    host = jax.device_get(trainable)
    if setup.config is None:  # MTP only: write the new head back into a copy of the checkpoint
        return export.write_back_mtp(fv.init_checkpoint, export_dir, setup.cfg, host["mtp"], overwrite=True)
    return export.export_checkpoint(export_dir, setup.config, host, setup.data.tokenizer, dtype, max_shard_bytes,
                                    overwrite=True)


# ---- command line -------------------------------------------------------------------------------------

_HELP_ARGS = ("-h", "-help", "--help", "--helpshort", "--helpfull", "-?")
_probe = flags.FlagValues()
define_flags(_probe)
_OWN_FLAGS = frozenset(_probe)
del _probe


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad flags or input)."""
    argv = list(sys.argv if argv is None else argv)
    fv = flags.FlagValues()
    define_flags(fv)
    if any(a in _HELP_ARGS for a in argv[1:]):
        print(f"usage: python -m qmtp.train --out_dir=RUN [flags]   (or --flagfile=configs/train_demo.flags)\n\n"
              f"{__doc__}\nflags:\n{fv.get_help(prefix='  ', include_special_flags=False)}")
        return 0
    try:
        rest = fv(argv)
        if len(rest) > 1:
            raise ValueError(f"unexpected arguments: {' '.join(rest[1:])}")
        if not fv.out_dir:
            raise ValueError("--out_dir is required")
        summary = run(fv)
    except (flags.Error, ValueError, FileExistsError) as e:
        print(f"train: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("step", "trained_parameters", "last_eval") if k in summary}
                     | ({"export": summary["export"]["dir"]} if "export" in summary else {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
