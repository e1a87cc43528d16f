"""The flags of `python -m qmtp.train`, defined on a given FlagValues (each CLI call and test builds
its own set), the flags a --resume may change, and the command-line wrapper of qmtp.train's CLIs."""

from __future__ import annotations

import functools
import sys

from absl import flags

# flags that may differ between a run and its --resume (everything else must match)
RESUME_FREE = {"out_dir", "resume", "stop_at_step", "export_dir", "export_dtype", "export_max_shard_bytes",
               "final_eval_windows", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "flagfile"}
HELP_ARGS = ("-h", "-help", "--help", "--helpshort", "--helpfull", "-?")


def cli(argv, define, usage: str, name: str, body) -> int:
    """A command line over a fresh FlagValues filled by `define`: help prints `usage` and the flags; else
    prints `body(fv)` (status 0), or `NAME: error: ...` for bad flags or input (status 2)."""
    argv = list(sys.argv if argv is None else argv)
    fv = flags.FlagValues()
    define(fv)
    if any(a in HELP_ARGS for a in argv[1:]):
        print(f"{usage}\nflags:\n{fv.get_help(prefix='  ', include_special_flags=False)}")
        return 0
    try:
        rest = fv(argv)
        if len(rest) > 1:
            raise ValueError(f"unexpected arguments: {' '.join(rest[1:])}")
        print(body(fv))
        return 0
    except (flags.Error, ValueError, FileExistsError) as e:
        print(f"{name}: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


def define_flags(fv: flags.FlagValues) -> None:
    s, i, f, b, e = (functools.partial(define, flag_values=fv) for define in (
        flags.DEFINE_string, flags.DEFINE_integer, flags.DEFINE_float, flags.DEFINE_bool, flags.DEFINE_enum))
    # run
    s("out_dir", None, "Run directory (required): data, orbax checkpoints, metrics, loss.png, export/.")
    b("resume", False, "Continue the run in --out_dir from its latest checkpoint (flags must match the run's).")
    i("stop_at_step", 0, "Stop after this step (checkpoint written, no export); 0 = run to --steps.", lower_bound=0)
    i("seed", 0, "Seed of the initial weights and of the batch order.", lower_bound=0)
    # data
    s("corpus_dir", "", "Comma-separated directories of *.py training text; the words 'stdlib' and 'site-packages' "
      "name this interpreter's standard library and installed packages; empty = stdlib.")
    i("corpus_max_bytes", 0, "Read at most this many bytes of text (0 = all), in hash order.", lower_bound=0)
    i("tokenizer_max_bytes", 0, "Train the tokenizer on at most this many bytes of text (0 = all).", lower_bound=0)
    b("corpus_include_tests", True, "Include test/ and tests/ directories of the corpus.")
    f("eval_fraction", 0.02, "Share of the files held out (by path hash).", lower_bound=0.0, upper_bound=0.5)
    i("vocab_size", 4096, "Ids of the byte-level BPE tokenizer trained on the corpus = the model's vocab_size "
      "(last three: <|endoftext|>, <|im_start|>, <|im_end|>).", lower_bound=260)
    # model (Qwen3.5 text_config fields)
    i("hidden_size", 256, "E: residual width.", lower_bound=8)
    i("intermediate_size", 768, "F: SwiGLU width.", lower_bound=8)
    i("num_layers", 6, "Decoder layers (MTP layer not counted).", lower_bound=1)
    i("full_attention_interval", 3, "Layer i is full attention iff (i+1) % interval == 0; the rest are Gated "
      "DeltaNet (Qwen3.5: 4).", lower_bound=1)
    i("num_attention_heads", 4, "Hq: query heads of the gated attention layers (and the MTP layer).", lower_bound=1)
    i("num_key_value_heads", 2, "Hkv: KV heads (divides Hq).", lower_bound=1)
    i("head_dim", 64, "D: attention head dimension.", lower_bound=2)
    f("partial_rotary_factor", 0.25, "RoPE on the first D * factor dims of each head (Qwen3.5: 0.25).")
    f("rope_theta", 10000.0, "RoPE base.")
    i("linear_num_key_heads", 2, "Hk: GDN key heads.", lower_bound=1)
    i("linear_num_value_heads", 4, "Hv: GDN value heads (a multiple of Hk).", lower_bound=1)
    i("linear_key_head_dim", 64, "Dk: GDN key head dimension.", lower_bound=1)
    i("linear_value_head_dim", 64, "Dv: GDN value head dimension.", lower_bound=1)
    i("linear_conv_kernel_dim", 4, "W: GDN causal conv width.", lower_bound=2)
    b("tie_word_embeddings", False, "Share embed_tokens as the LM head (no lm_head.weight).")
    i("max_position_embeddings", 4096, "Longest sequence the exported config allows.", lower_bound=16)
    f("init_std", 0.02, "Std of the initial linear / embedding weights (residual outputs / sqrt(2 L)).")
    # optimisation
    i("steps", 1000, "Optimizer steps.", lower_bound=1)
    i("batch_size", 32, "Sequences per step.", lower_bound=1)
    i("seq_len", 512, "Tokens per sequence (>= 3).", lower_bound=3)
    f("learning_rate", 2e-3, "Peak learning rate (AdamW).")
    i("warmup_steps", 100, "Linear warm-up steps from 0 to --learning_rate.", lower_bound=0)
    f("min_lr_ratio", 0.1, "The cosine decay ends at learning_rate * this.")
    f("weight_decay", 0.1, "AdamW decoupled weight decay (matrices only; not norms, A_log, dt_bias).")
    f("grad_clip", 1.0, "Clip the global gradient norm to this.")
    f("adam_b1", 0.9, "AdamW beta1.")
    f("adam_b2", 0.95, "AdamW beta2.")
    f("mtp_loss_weight", 0.3, "lambda in L = L_main + lambda * L_mtp (DeepSeek-V3: 0.3).", lower_bound=0.0)
    i("mtp_depth", 1, "MTP chain depths trained (1..4): depth d feeds the MTP its own depth d-1 output, as drafting "
      "K >= 2 does, and predicts the token d+1 ahead; L_mtp is the mean over depths.", lower_bound=1, upper_bound=4)
    e("compute_dtype", "bfloat16", ["bfloat16", "float32"], "Dtype of the forward (weights are float32 masters).")
    # logging / checkpoints
    i("log_every", 10, "Progress line and metrics row every N steps.", lower_bound=1)
    i("eval_every", 200, "Held-out losses and MTP acceptance every N steps (0 = at start and end).", lower_bound=0)
    i("eval_batches", 4, "Batches of held-out windows per evaluation.", lower_bound=1)
    i("checkpoint_every", 500, "Orbax checkpoint every N steps (and at the end).", lower_bound=1)
    i("keep_checkpoints", 2, "Orbax checkpoints kept.", lower_bound=1)
    # export
    s("export_dir", "", "HF-format output written at the end (default: OUT_DIR/export).")
    e("export_dtype", "bf16", ["bf16", "fp32"], "Storage dtype of the exported tensors (joint runs).")
    s("export_max_shard_bytes", "14MB", "Largest exported safetensors file (bytes, or 14MB / 10MiB).")
    b("export_best", False, "Export the parameters of the evaluation with the lowest held-out loss (early stopping; "
      "kept under OUT_DIR/best) instead of the last step's. Evaluations happen every --eval_every steps.")
    i("final_eval_windows", 16, "Held-out windows for the final qmtp.mtp_logits acceptance on the exported "
      "checkpoint (loaded strictly with qmtp.load); 0 = skip.", lower_bound=0)
    # MTP only
    b("train_mtp_only", False, "Freeze the target of --init_checkpoint and train only its mtp.* tensors; the "
      "export is a copy of the checkpoint with the new MTP tensors.")
    s("init_checkpoint", "", "Checkpoint directory qmtp can load (with tokenizer.json), for --train_mtp_only.")
    e("mtp_data", "corpus", ["corpus", "self_distill"], "MTP-only training text: corpus windows, or the target's "
      "greedy continuations of corpus prompts (MTP loss on the generated tokens only).")
    i("self_distill_sequences", 256, "Continuations generated for --mtp_data=self_distill.", lower_bound=1)
    i("self_distill_prompt_len", 32, "Corpus tokens prompting each continuation (< --seq_len).", lower_bound=1)
