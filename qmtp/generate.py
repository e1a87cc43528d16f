"""Command line generation: python -m qmtp.generate --flagfile=configs/tiny.flags

Loads a checkpoint (or builds a synthetic preset on first use with --checkpoint=preset:NAME),
runs greedy decoding (plain, or MTP speculative with --mtp_k) with the loop on the device, prints
the text, tokens/s and MTP acceptance statistics (with --compare_plain, plain decoding's tokens/s
from the same run beside them), and optionally writes everything to --output_json. With --score it
generates nothing: it prints each prompt's negative log-likelihood and perplexity under the model
(qmtp.score; with --logprobs N, each token's log-probability and N alternatives). What it is doing
(loading, compiling, generating, with seconds) goes to stderr. Bad input ends with one line on
stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

from absl import flags

from qmtp import cli_help, cli_progress


FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None,
                    "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), or "
                    "'preset:NAME[:DTYPE]' for a synthetic checkpoint built on first use into the cache "
                    "($QMTP_CACHE or ~/.cache/qmtp), e.g. preset:tiny or preset:tiny:fp8.")
flags.DEFINE_multi_string("prompt", [], "A text prompt (repeat the flag for a batch). Needs tokenizer.json.")
flags.DEFINE_multi_string("prompt_file", [], "A file whose whole text (UTF-8, newlines kept) is one prompt: "
                          "multi-line code or documents (repeatable; joins the --prompt batch).")
flags.DEFINE_multi_string("prompt_ids", [], "A prompt as comma-separated token ids, e.g. '1,2,3' "
                          "(repeatable; combined with --prompt into one batch).")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate per prompt (the EOS token counts).", lower_bound=1)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"],
                  "Compute dtype for activations and non-FP8 weights (FP8 weights stay FP8).")
flags.DEFINE_integer("page_size", 16, "Tokens per KV-cache page.", lower_bound=1)
flags.DEFINE_integer("num_pages", 0, "KV-cache pages in total; 0 = exactly what the batch needs.", lower_bound=0)
flags.DEFINE_enum("impl", "ref", ["ref", "pallas"],
                  "Kernel implementation: 'ref' (pure XLA) or 'pallas' (Pallas GPU kernels where they exist; "
                  "interpret mode on the CPU, which is slow).")
flags.DEFINE_list("stop_token_ids", None, "Stop ids (default: eos_token_id of generation_config.json).")
flags.DEFINE_enum("mtp_k", "0", ["0", "1", "2", "3", "4", "auto"],
                  "Drafts per round for MTP speculative decoding (1-4); 0 = plain decoding; 'auto' = each round runs "
                  "the K of 0, 1, 3 with the most expected tokens per second, from the rows' recent acceptance and "
                  "the seconds of a round at each K (timed on the batch first). Greedy tokens are the same either "
                  "way, sampled ones follow the same distribution (speculative sampling); MTP needs a checkpoint "
                  "with mtp.* tensors.")
flags.DEFINE_integer("tp", 1, "Tensor parallelism: split the model over this many devices (each loads only its "
                     "shard; the tokens are the same as with 1). Must divide the model's head counts, MLP width "
                     "and vocabulary; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices.",
                     lower_bound=1)
flags.DEFINE_string("converted_cache", None, "Directory of an orbax cache of the converted (and sharded) "
                    "parameters: the first load writes it, later loads of the same checkpoint files, dtype and --tp "
                    "restore from it instead of reading the safetensors.")
cli_help.define_sampling_flags()
cli_help.define_model_flags()
flags.DEFINE_boolean("warmup", True, "Compile before timing, so tok/s measures execution only.")
flags.DEFINE_integer("repeats", 1, "Time the generation this many times and report the run of median tok/s "
                     "(with --compare_plain the modes alternate).", lower_bound=1)
flags.DEFINE_boolean("compare_plain", False, "With --mtp_k: also decode the prompts plainly (K = 0) in the same run, "
                     "then print both speeds, the speed-up, and whether the tokens are identical.")
flags.DEFINE_integer("logprobs", None, "Also report each generated token's log-probability under the model (at the "
                     "sampling temperature, before top_k/top_p/min_p) and this many most likely alternatives "
                     "(0-20): printed one line per token and written to --output_json.", lower_bound=0,
                     upper_bound=20)
flags.DEFINE_string("output_json", None, "Write prompts, tokens, text, timings and tok/s to this file.")
flags.DEFINE_boolean("score", False, "Score the prompts instead of generating: each prompt's negative log-likelihood "
                     "(sum and per token, in nats) and perplexity exp(NLL / tokens) over its tokens after the first "
                     "(qmtp.score: temperature 1, no sampling adjustment); with --logprobs N also a line per token "
                     "with its rank and N alternatives. Written to --output_json too.")


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt_ids={text!r}: expected comma-separated integers") from None


def read_prompt_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt_file={path}: {e}") from None
    if not text:
        raise ValueError(f"--prompt_file={path}: the file is empty")
    return text


def logprob_lines(model, logprobs) -> list[str]:
    """One line per token: its id (and text), its logprob, then the alternatives."""
    def show(token):
        return f"{token} {model.tokenizer.decode([token])!r}" if model.tokenizer is not None else str(token)
    return [f"{show(t.token)}: {t.logprob:.4f}" + ("  | " + ", ".join(f"{show(i)}: {v:.4f}" for i, v in t.top)
                                                 if t.top else "") for t in logprobs]


def median_run(results):
    """The run of median decode tok/s (the upper one of an even count); each repeat gives the same tokens."""
    return sorted(results, key=lambda r: r.stats["decode_tokens_per_s"])[len(results) // 2]


def run(argv) -> dict:
    import qmtp
    from qmtp.tools import make_checkpoint
    if len(argv) > 1:
        raise ValueError(f"unexpected positional arguments {argv[1:]} (use --prompt)")
    if not FLAGS.checkpoint:
        raise ValueError("--checkpoint is required (a checkpoint directory or preset:tiny)")
    prompts = (list(FLAGS.prompt) + [read_prompt_file(p) for p in FLAGS.prompt_file]
               + [parse_ids(p) for p in FLAGS.prompt_ids])
    if not prompts:
        raise ValueError("give at least one --prompt, --prompt_file or --prompt_ids")
    stop = None if FLAGS.stop_token_ids is None else parse_ids(",".join(FLAGS.stop_token_ids))
    cli_help.check_output_file("output_json", FLAGS.output_json)
    k = cli_help.mtp_k_from_flag(FLAGS.mtp_k)
    if FLAGS.score and (k or FLAGS.compare_plain):
        raise ValueError("--score scores the prompts and generates nothing: leave out --mtp_k and --compare_plain")
    if FLAGS.compare_plain and not k:
        raise ValueError("--compare_plain compares MTP with plain decoding: give --mtp_k too")
    sampling = cli_help.sampling_from_flags()
    cli_help.apply_compile_cache_flag()
    phases = cli_progress.Phases("generate")
    phases(f"loading {FLAGS.checkpoint}", tick=False)  # the reader shows its own progress on large checkpoints
    path = make_checkpoint.resolve_checkpoint(FLAGS.checkpoint)
    model = qmtp.load(path, dtype=FLAGS.dtype, page_size=FLAGS.page_size,
                      num_pages=FLAGS.num_pages or None, impl=FLAGS.impl, tp=FLAGS.tp,
                      converted_cache=FLAGS.converted_cache, draft_head=FLAGS.draft_head,
                      draft_vocab=FLAGS.draft_vocab, fp8_act_quant=FLAGS.fp8_act_quant,
                      deterministic=FLAGS.deterministic, prefill_chunk=FLAGS.prefill_chunk)
    if FLAGS.score:
        return score_prompts(model, prompts, phases)
    from qmtp.runtime import adaptive_k
    most = adaptive_k.CANDIDATES[-1] if k == qmtp.api.AUTO else k  # the most drafts of a round
    warning = cli_help.verify_rows_warning(model, len(prompts), most)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    def generate(mode, first):
        return qmtp.generate(model, prompts, max_new_tokens=FLAGS.max_new_tokens, stop_token_ids=stop, mtp_k=mode,
                             logprobs=FLAGS.logprobs, warmup=FLAGS.warmup and first, progress=phases, **sampling)

    # the modes alternate, so a slow stretch of a shared machine falls on both; each keeps its median run
    modes = ([0] if FLAGS.compare_plain else []) + [k]
    runs = {mode: [] for mode in modes}
    for r in range(FLAGS.repeats):
        for mode in modes:
            runs[mode].append(generate(mode, r == 0))
    phases.done()
    plain, result = (median_run(runs[0]) if FLAGS.compare_plain else None), median_run(runs[k])
    for i, tokens in enumerate(result.tokens):
        shown = prompts[i] if isinstance(prompts[i], str) else f"ids {prompts[i]}"
        print(f"[{i}] prompt: {shown!r}")
        if result.texts is not None:
            print(f"[{i}] text: {result.texts[i]!r}")
        print(f"[{i}] tokens: {tokens}")
        if result.logprobs is not None:
            for line in logprob_lines(model, result.logprobs[i]):
                print(f"[{i}]   {line}")
    s = result.stats
    print(f"batch {s['batch']}: {s['new_tokens']} new tokens, TTFT {s['ttft_s'] * 1e3:.1f} ms, "
          f"decode {s['decode_tokens_per_s']:.1f} tok/s ({s['steps']} steps in {s['decode_s'] * 1e3:.1f} ms), "
          f"compile/warm-up {runs[k][0].stats['warmup_s']:.1f} s"
          + (f"; the median of {FLAGS.repeats} runs" if FLAGS.repeats > 1 else ""))
    if k:
        print(f"MTP K={k}: {s['rounds']} rounds, {s['accepted']}/{s['drafted']} drafts accepted "
              f"({s['acceptance_rate']:.1%}), mean accepted length {s['mean_accepted_length']:.2f} tokens/round, "
              "per-position acceptance " + " / ".join(f"{x:.2f}" for x in s["position_acceptance"]))
        if k == qmtp.api.AUTO:
            rounds = ", ".join(f"K={kk}: {n}" for kk, n in s["k_rounds"].items())
            costs = ", ".join(f"K={kk}: {c * 1e3:.2f} ms" for kk, c in s["round_cost_s"].items())
            print(f"rounds per K: {rounds}; seconds per round: {costs}")
    if plain is not None:
        p = plain.stats
        same = plain.tokens == result.tokens
        tokens = ("sampled: the same distribution, not the same tokens" if FLAGS.temperature > 0 else
                  f"tokens {'identical' if same else 'DIFFERENT'}")
        print(f"plain {p['decode_tokens_per_s']:.1f} tok/s, MTP K={k} {s['decode_tokens_per_s']:.1f} tok/s: "
              f"{s['decode_tokens_per_s'] / p['decode_tokens_per_s']:.2f}x; {tokens} (same prompts, same run)")
    report = {"checkpoint": model.checkpoint_dir, "dtype": FLAGS.dtype, "impl": FLAGS.impl, "mtp_k": k,
              "draft_head": model.draft_head, "tp": FLAGS.tp, "fp8_act_quant": FLAGS.fp8_act_quant,
              "deterministic": FLAGS.deterministic, "prefill_chunk": FLAGS.prefill_chunk,
              "prompts": prompts, "prompt_lengths": result.prompt_lengths, "tokens": result.tokens,
              "texts": result.texts, "stats": s,
              "logprobs": None if result.logprobs is None else [[dataclasses.asdict(t) for t in row]
                                                                for row in result.logprobs], "repeats": FLAGS.repeats,
              "decode_tokens_per_s_runs": [r.stats["decode_tokens_per_s"] for r in runs[k]]}
    if plain is not None:
        report["plain"] = {"tokens": plain.tokens, "stats": plain.stats, "tokens_identical": plain.tokens == result.tokens,
                           "decode_tokens_per_s_runs": [r.stats["decode_tokens_per_s"] for r in runs[0]]}
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def score_prompts(model, prompts, phases) -> dict:
    """--score: each prompt's NLL and perplexity (and with --logprobs its tokens' lines), printed and written."""
    import qmtp
    phases("scoring")
    scores = qmtp.score(model, prompts, top_logprobs=FLAGS.logprobs or 0)
    phases.done()
    rows = []
    for i, (prompt, scored) in enumerate(zip(prompts, scores)):
        nll = -sum(t.logprob for t in scored)
        n = len(scored)
        perplexity = math.exp(nll / n) if n else None
        shown = prompt if isinstance(prompt, str) else f"ids {prompt}"
        print(f"[{i}] prompt: {shown!r}")
        print(f"[{i}] {n} tokens scored: NLL {nll:.4f} nats ({nll / max(n, 1):.4f} per token), perplexity "
              + (f"{perplexity:.4f}" if n else "- (a one-token prompt has nothing to score)"))
        if FLAGS.logprobs is not None:
            for line, t in zip(logprob_lines(model, scored), scored):
                print(f"[{i}]   {line}  (rank {t.rank})")
        rows.append({"prompt": prompt, "tokens_scored": n, "nll": nll, "perplexity": perplexity,
                     "logprobs": [dataclasses.asdict(t) for t in scored]})
    report = {"checkpoint": model.checkpoint_dir, "dtype": FLAGS.dtype, "impl": FLAGS.impl, "tp": FLAGS.tp,
              "scores": rows}
    if FLAGS.output_json:
        with open(FLAGS.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def main(argv):
    from qmtp.model.checkpoint import CheckpointError
    from qmtp.model.config import ConfigError
    try:
        run(argv)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    cli_help.run(main, __doc__)


if __name__ == "__main__":
    cli()
