"""The one absl entry-point wrapper of qmtp's command lines (generate, bench, server, train) and the
flag helpers they share."""

from __future__ import annotations

import sys

from absl import app, flags

HELP_ARGS = ("--help", "-h", "--helpshort")


def run(main, doc: str, module: str | None = None) -> None:
    """app.run(main), except that a help request prints `doc` and every flag of `module` (the module
    that defines the command's flags; default: the main module) and exits 0 (absl exits with status 1
    after --help; asking for help is not an error), and that a bad flag (unknown, malformed, out of
    range) ends with one `error: ...` line and exit status 2, as every other bad input does."""
    if any(a in HELP_ARGS for a in sys.argv[1:]):
        flags.FLAGS(sys.argv[:1])
        print(doc)
        print(flags.FLAGS.module_help(module) if module else flags.FLAGS.main_module_help())
        if flags.FLAGS.get_key_flags_for_module(__name__):  # flags shared by the entry points
            print(flags.FLAGS.module_help(__name__))
        sys.exit(0)
    try:
        argv = flags.FLAGS(sys.argv)
    except flags.Error as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    app.run(main, flags_parser=lambda _: argv)  # parsed once: a second parse would repeat multi-flags


def _define_once(define, name: str, *args, **kw) -> None:
    """define(name, *args, **kw) unless the flag exists: generate, bench and server share these flags and
    may share one process (tests)."""
    if name not in flags.FLAGS:
        define(name, *args, **kw)


def define_fp8_act_quant_flag() -> None:
    """--fp8_act_quant (KernelConfig.fp8_act_quant), for generate, bench, server."""
    _define_once(flags.DEFINE_boolean, "fp8_act_quant", False,
                 "FP8 checkpoints: quantize the activations of projections of up to 128 rows (decode, verify) to E4M3"
                 " per row and 128 features and multiply on the FP8 tensor cores, as the checkpoints' dynamic "
                 "activation scheme says (MODEL_SPEC 5.3). Changes the numbers slightly (and so, rarely, a greedy "
                 "token); off: exact activations.")


def define_deterministic_flag() -> None:
    """--deterministic (KernelConfig.deterministic), for generate, server and the exactness check."""
    _define_once(flags.DEFINE_boolean, "deterministic", False,
                 "With --impl=pallas: row-invariant numerics (every bf16 and FP8 projection with one tile config per "
                 "weight shape at every row count, RMSNorm one program per row, attention at fixed key splits, "
                 "prefill one prompt of whole --prefill_chunk chunks at a time), so a sequence's greedy tokens do "
                 "not depend on --mtp_k or on the other sequences of its batch, in bfloat16 too. Costs decode speed "
                 "at some batch sizes and prefill speed (README: Exactness).")


def define_sampling_flags() -> None:
    """--temperature, --top_k, --top_p, --min_p, --seed, --presence_penalty, --frequency_penalty,
    --repetition_penalty, --logit_bias, --allowed_token_ids, --min_tokens (qmtp.generate's sampling), for generate
    and bench."""
    _define_once(flags.DEFINE_float, "temperature", 0.0, "Sampling temperature; 0 = greedy decoding. Sampling "
                 "applies, in this order, the temperature, --top_k, --top_p and --min_p; with MTP, speculative "
                 "sampling (the same distribution, not the same tokens).")
    _define_once(flags.DEFINE_integer, "top_k", 0, "Sample among the k most likely tokens only; 0 = all.")
    _define_once(flags.DEFINE_float, "top_p", 1.0, "Sample among the most likely tokens whose probability adds up "
                 "to top_p; 1 = all.")
    _define_once(flags.DEFINE_float, "min_p", 0.0, "Drop tokens less likely than min_p times the most likely one; "
                 "0 = none.")
    _define_once(flags.DEFINE_integer, "seed", None, "Seed of the sampling (a prompt's draws depend only on it and "
                 "the position, so a prompt gets the same tokens in any batch); default: a random one "
                 "(qmtp.bench: 0, the same draws in every repeat).")
    _define_once(flags.DEFINE_float, "presence_penalty", 0.0, "Subtracted from the logit of every token the "
                 "sequence already generated (the OpenAI API's; -2 .. 2, 0 = off); greedy decoding takes the argmax "
                 "of the penalized logits. Applies before the temperature.")
    _define_once(flags.DEFINE_float, "frequency_penalty", 0.0, "Subtracted from a token's logit once per time "
                 "the sequence already generated it (the OpenAI API's; -2 .. 2, 0 = off).")
    _define_once(flags.DEFINE_float, "repetition_penalty", 1.0, "Divides the positive logits (multiplies the "
                 "others) of the tokens in the prompt or already generated (HF's and vLLM's; > 0, 1 = off, "
                 "1.05-1.2 typical). Applies after --logit_bias, before the presence and frequency penalties.")
    _define_once(flags.DEFINE_list, "logit_bias", [], "ID:BIAS,... added to those token ids' logits before the "
                 "penalties and the temperature (the OpenAI API's; -100 .. 100, up to 300 ids): -100 bans a token, "
                 "100 forces it.")
    _define_once(flags.DEFINE_list, "allowed_token_ids", None, "ID,... : the only token ids a sequence may produce "
                 "(vLLM's; up to 300): every other id's logit is -inf. --logit_bias applies to these.")
    _define_once(flags.DEFINE_integer, "min_tokens", 0, "No stop id ends a sequence before it has generated this "
                 "many tokens: until then the stop ids' logits are -inf (vLLM's; 0 = off).", lower_bound=0)


def sampling_from_flags(default_seed: int | None = None) -> dict:
    """qmtp.generate's sampling arguments from the flags (--seed unset: default_seed); ValueError naming
    the flag of a value out of range, before anything loads."""
    import qmtp
    f = flags.FLAGS
    args = dict(temperature=f.temperature, top_k=f.top_k, top_p=f.top_p, min_p=f.min_p,
                seed=default_seed if f.seed is None else f.seed, presence_penalty=f.presence_penalty,
                frequency_penalty=f.frequency_penalty, repetition_penalty=f.repetition_penalty,
                min_tokens=f.min_tokens)
    try:
        pairs = [entry.split(":") for entry in f.logit_bias]
        args["logit_bias"] = {int(token): float(bias) for token, bias in pairs} or None
    except ValueError:
        raise ValueError(f"--logit_bias={','.join(f.logit_bias)}: expected ID:BIAS,... (e.g. 151643:-100)") from None
    try:
        args["allowed_token_ids"] = None if f.allowed_token_ids is None else [int(t) for t in f.allowed_token_ids]
    except ValueError:
        raise ValueError(f"--allowed_token_ids={','.join(f.allowed_token_ids)}: expected ID,... (e.g. 16,17)") from None
    try:
        qmtp.sampling_params(1, **args)
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    return args


def define_prefill_chunk_flag() -> None:
    """--prefill_chunk (KernelConfig.prefill_chunk), for generate, bench, server."""
    from qmtp.runtime.kernel_config import DEFAULT_PREFILL_CHUNK
    _define_once(flags.DEFINE_integer, "prefill_chunk", DEFAULT_PREFILL_CHUNK,
                 "Prompts longer than this many tokens (a power of two >= 16) are prefilled in chunks of it, each "
                 "after the KV and GDN state the one before left: prefill memory grows linearly with the prompt, not "
                 "with its square.")


def define_draft_head_flag() -> None:
    """--draft_head (qmtp.load's draft_head), for generate, bench, server."""
    _define_once(flags.DEFINE_enum, "draft_head", "auto", ["auto", "bf16", "fp8"],
                 "MTP drafts: 'bf16' uses the shared lm_head; 'fp8' an FP8 128x128-block copy of it made at load "
                 "(half the bytes per draft step, 1.27 GB more memory at 27B); 'auto': 'fp8' for FP8 checkpoints, "
                 "else 'bf16'. The verify pass keeps the exact lm_head: the tokens do not change, only how many "
                 "drafts are accepted may.")


def define_draft_vocab_flag() -> None:
    """--draft_vocab (qmtp.load's draft_vocab), for generate, bench, server."""
    _define_once(flags.DEFINE_string, "draft_vocab", None,
                 "MTP drafts choose among these token ids only (a file: a JSON list or whitespace-separated ids; "
                 "scripts/hot_vocab.py builds one from text): the draft head reads just their rows. Tokens are "
                 "unchanged; acceptance may drop (scripts/draft_head_acceptance.py --draft_vocab measures it).")


def define_compile_cache_flag() -> None:
    """--compile_cache (qmtp.runtime.compile_cache), for generate, bench, server."""
    _define_once(flags.DEFINE_string, "compile_cache", "auto",
                 "JAX's persistent compilation cache: a later run of the same programs loads them from disk instead "
                 "of compiling (~100 s per speculative loop at 27B). 'auto': $QMTP_CACHE/jax_compile ($QMTP_CACHE "
                 "defaults to ~/.cache/qmtp); 'off': no cache; otherwise a directory. Entries are keyed by the whole "
                 "program, versions, device and XLA_FLAGS, so changed code or settings compile afresh.")


def define_model_flags(deterministic: bool = True) -> None:
    """The flags of how qmtp.load builds the model and where compiled programs are kept: --fp8_act_quant,
    --deterministic (unless deterministic=False: qmtp.bench names the mode in --engine), --prefill_chunk,
    --draft_head, --draft_vocab, --compile_cache; for generate, bench, server."""
    define_fp8_act_quant_flag()
    if deterministic:
        define_deterministic_flag()
    define_prefill_chunk_flag()
    define_draft_head_flag()
    define_draft_vocab_flag()
    define_compile_cache_flag()


def apply_compile_cache_flag() -> str | None:
    """Turns the cache of --compile_cache on; returns its directory (None when off)."""
    from qmtp.runtime import compile_cache
    directory = compile_cache.resolve(flags.FLAGS.compile_cache)
    return compile_cache.enable(directory) if directory else None


def mtp_k_from_flag(value: str) -> int | str:
    """--mtp_k's text (an enum of "0".."4" and "auto") as qmtp.generate and the engine take it."""
    from qmtp import api
    return value if value == api.AUTO else int(value)


def bytes_or_auto_from_flag(name: str, value: str) -> int | str:
    """A flag's text that is "auto" or a byte count >= 0, as the engine takes it; ValueError naming the flag."""
    from qmtp import api
    if value == api.AUTO:
        return value
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"--{name}={value}: a byte count >= 0 or {api.AUTO!r}")
    return count


def verify_rows_warning(model, batch: int, k: int, unit: str = "sequences") -> str | None:
    """A warning when MTP verify passes (batch x (K+1) rows) leave the FP8 decode kernel (more than
    ops.DECODE_MAX_ROWS rows run compute-bound GEMM tiles: WORKSPACE.md), else None; unit: what the
    batch counts, as the command line calls it."""
    from qmtp.runtime import ops
    rows, limit = batch * (k + 1), ops.DECODE_MAX_ROWS
    if not k or model.impl != "pallas" or model.cfg.quantization is None or rows <= limit:
        return None
    fits = max((kk for kk in range(1, k) if batch * (kk + 1) <= limit), default=0)
    advice = f"--mtp_k={fits} keeps them on it" if fits else f"at most {limit // 2} {unit} at K=1 keep them on it"
    runs = (f"they run as decode launches of {limit} rows, each reading all the weights" if model.kernels.deterministic
            else "they run on GEMM tiles, which are compute-bound at that size")
    return (f"warning: {batch} {unit} x (K+1 = {k + 1}) = {rows} rows per MTP verify pass exceed the FP8 "
            f"decode kernel's {limit}; {runs} and may make MTP slower than plain decoding; {advice}")


def check_output_file(flag: str, path: str | None) -> None:
    """Raises ValueError naming --flag unless `path` can be written: its directory exists and is
    writable, and the path is not a directory. Called before any loading, so a long run does not end
    in a write that was bound to fail."""
    import os
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--{flag}={path}: is a directory, expected a file path")
    if not os.path.isdir(directory):
        raise ValueError(f"--{flag}={path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise ValueError(f"--{flag}={path}: directory {directory} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"--{flag}={path}: the file exists and is not writable")


def check_output_dir(flag: str, path: str | None) -> None:
    """Raises ValueError naming --flag unless `path` is a writable directory or can be created (its
    nearest existing ancestor is a writable directory). Creates nothing."""
    import os
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--{flag}={path}: exists and is not a directory")
    ancestor = os.path.abspath(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"--{flag}={path}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK):
        raise ValueError(f"--{flag}={path}: {ancestor} is not writable")
