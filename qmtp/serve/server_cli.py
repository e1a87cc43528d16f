"""OpenAI-compatible HTTP server: python -m qmtp.server --flagfile=configs/server_tiny.flags

FastAPI + uvicorn in front of one continuous-batching engine (qmtp/serve/engine.py; greedy or sampled
decoding, MTP speculative decoding with --mtp_k). Listens on 127.0.0.1 unless --host says otherwise.
This module is the command line (flags -> model, engine and app, then uvicorn); the routes are
qmtp/serve/server.py's, the request fields, error statuses and bodies qmtp/serve/protocol.py's.

Start-up: the server listens at once and the engine thread compiles every program a request can call
(each prompt bucket's prefills, or the prefix cache's passes, then the decode loop: --warmup_buckets), one log
line per program with its seconds and a total line; meanwhile /health answers 503 {"status": "warming
up", "programs_done", "programs"} and requests 503 (code warming_up). A compile after that (a bucket
left out of --warmup_buckets) is logged as "compiled while serving: ..." with its seconds.

SIGINT / SIGTERM: queued requests are aborted (503, or an error event when streaming), active ones
get --shutdown_timeout_s to finish (a warm-up stops after its current program), then the process
exits 0. Bad flags or checkpoints end with one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import flags

from qmtp import cli_help
from qmtp.serve import reasoning, sampling_defaults, tool_calls
from qmtp.serve.chat_template import ChatTemplate
from qmtp.serve.server import Server, ServerSettings, create_app
from qmtp.tools.make_checkpoint import PRESET_PREFIX, resolve_checkpoint

API_KEY_ENV = "QMTP_API_KEY"  # --api_key's default

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The server's flags (defined on demand: qmtp.generate defines flags of the same names)."""
    flags.DEFINE_string("checkpoint", None, "Hugging Face checkpoint directory, or 'preset:NAME[:DTYPE]' for a "
                        "synthetic checkpoint built on first use (e.g. preset:tiny).")
    flags.DEFINE_integer("num_layers", None, "Presets only: serve a slice of the preset with this many decoder layers "
                         "(default: all), e.g. to measure serving at real layer shapes with shorter compiles.",
                         lower_bound=1)
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype (FP8 weights stay FP8).")
    flags.DEFINE_enum("impl", "ref", ["ref", "pallas"], "Kernels: 'ref' (pure XLA) or 'pallas' (GPU kernels).")
    flags.DEFINE_integer("tp", 1, "Tensor parallelism: split the model over this many devices.", lower_bound=1)
    flags.DEFINE_integer("page_size", 16, "Tokens per KV-cache page.", lower_bound=1)
    flags.DEFINE_integer("num_pages", 0, "KV pages in the pool; 0 = batch_slots x the pages of one max_model_len "
                         "request (a request then never waits for pages).", lower_bound=0)
    flags.DEFINE_enum("mtp_k", "auto", ["0", "1", "2", "3", "4", "auto"], "MTP drafts per round (1-4); 0 = plain "
                      "decoding; 'auto' (default) = each round runs the K of 0, 1, 3 with the most expected tokens per "
                      "second, from each request's recent acceptance and the seconds of a round at each K (timed in "
                      "the warm-up and kept with --compile_cache, so a later start on the same model, shapes and GPU "
                      "reuses them); by default, plain decoding for a checkpoint without an MTP layer. Same greedy "
                      "tokens either way.")
    flags.DEFINE_integer("batch_slots", 4, "Requests decoded together (every slot, busy or not, is a row of each "
                         "step). An MTP round verifies batch_slots x (K+1) rows: up to 128 stay on the FP8 decode "
                         "kernels, more run on compute-bound GEMM tiles (a warning names the K that fits).",
                         lower_bound=1)
    flags.DEFINE_integer("prefill_batch", 4, "Waiting prompts of one length bucket are prefilled in one pass of at "
                         "most this many (the weights read once for all; with the prefix cache, prompts whose next "
                         "passes have one width); 1 = one at a time.", lower_bound=1)
    flags.DEFINE_integer("max_prefill_tokens", 8192, "Rows x bucket length of one batched prefill at most "
                         "(bounds its activation memory).", lower_bound=1)
    flags.DEFINE_integer("interleave_piece", 0, "While other requests decode, a prompt longer than this many tokens "
                         "is prefilled in pieces of it, one per scheduling point, so their streams wait for one "
                         "piece at a time (a power of two from 16 to --prefill_chunk; smaller: shorter waits, a "
                         "slower prefill). A prompt arriving at an idle server goes in --prefill_chunk pieces. 0 = 128 "
                         "(at most --prefill_chunk; under --deterministic, --prefill_chunk).", lower_bound=0)
    flags.DEFINE_integer("rounds_per_call", 4, "MTP rounds (or plain steps) per device call between scheduling "
                         "points: lower = new requests join sooner, higher = fewer host round trips.", lower_bound=1)
    flags.DEFINE_integer("max_model_len", 0, "Prompt + completion token limit (sets each slot's page-table "
                         "width); 0 = 4096, or the model's max_position_embeddings - (K+1) where that is less "
                         "(so the default works with every --mtp_k).", lower_bound=0)
    flags.DEFINE_integer("max_tokens_limit", 4096, "Largest max_tokens a request may ask for.", lower_bound=1)
    flags.DEFINE_integer("default_max_tokens", 256, "max_tokens of a request that gives none (clipped to the context "
                         "left after the prompt).", lower_bound=1)
    flags.DEFINE_integer("max_queue", 64, "Requests waiting for a slot; beyond this: 429.", lower_bound=1)
    flags.DEFINE_integer("max_stop_ids", 8, "Stop token ids per request (the eos ids included).", lower_bound=1)
    flags.DEFINE_string("prefix_cache_bytes", "auto", "Device bytes for the prefix cache, 0 = off: prompts that "
                        "share leading blocks of --prefix_block tokens (a system prompt, a chat history) resume from "
                        "the GDN state kept at a block boundary and share its KV pages, prefilling only the rest; the "
                        "next turn after a response resumes at its end, the other choices of a request at the "
                        "prompt's end (one token prefilled). Greedy output is the same as without it. With it every "
                        "prompt is prefilled in passes of at most --prefill_chunk tokens. Its GDN states also stay "
                        "within the device memory the warm-up left, less 10% (logged where that binds first). auto: "
                        "that memory for the states and the KV pool for its pages (half the memory free at start "
                        "until the warm-up has run; 1 GiB of states where the device reports no memory).")
    flags.DEFINE_integer("prefix_block", 0, "Tokens per prefix cache block: a power of two, a multiple of "
                         "--page_size, at most --prefill_chunk; 0 = 64 (under --deterministic: --prefill_chunk, so "
                         "a resumed prefill runs the same passes as a full one).", lower_bound=0)
    flags.DEFINE_list("stop_token_ids", None, "Default stop ids (default: eos_token_id of generation_config.json).")
    flags.DEFINE_enum("generation_config", "auto", ["auto", "none"], "auto: a request that leaves temperature, "
                      "top_p, top_k or min_p out gets the value of the checkpoint's generation_config.json, where it "
                      "sets do_sample: true (as transformers and vLLM; e.g. Qwen3's temperature 0.6, top_p 0.95, "
                      "top_k 20), and one that leaves repetition_penalty out gets the file's; none: such a request "
                      "decodes greedily without a repetition penalty.")
    flags.DEFINE_enum("reasoning_parser", "auto", ["auto", "qwen3", "none"], "Chat replies: qwen3 puts the text "
                      "between <think> and </think> in message.reasoning_content (streaming: delta.reasoning_content) "
                      "and the rest in content, as vLLM's and SGLang's qwen3 parser do; a reply whose prompt ends "
                      "inside <think> (Qwen3.5's template, thinking on) starts in the reasoning, one whose prompt "
                      "closed it (chat_template_kwargs enable_thinking=false) in the content. auto (default): qwen3 "
                      "when the tokenizer has <think> and </think> tokens (Qwen3, Qwen3.5), else none; the choice "
                      "is logged at start. qwen3 leaves a model that does not think as it was: a reply starts in the "
                      "reasoning only where its prompt opened one or it opens with <think> itself. none: the text as "
                      "generated, all in content. /v1/completions always returns the text as generated.")
    flags.DEFINE_enum("tool_call_parser", "auto", ["auto", "qwen3_coder", "hermes", "none"], "Chat requests with "
                      "tools: the format of the model's calls, parsed into message.tool_calls (finish_reason "
                      "tool_calls). qwen3_coder: <tool_call><function=NAME><parameter=KEY>VALUE</parameter>"
                      "</function></tool_call> (Qwen3.5, Qwen3-Coder; a value typed by the tool's JSON schema); "
                      "hermes: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Qwen3, Qwen2.5). auto "
                      "(default): from the chat template, qwen3_coder where it writes <function=, else hermes where "
                      "it writes <tool_call>, else none; logged at start. tool_choice \"required\" or a named function "
                      "opens the reply with a call in this format (the model writes the rest). none: a request with "
                      "tools is refused (400) unless its tool_choice is \"none\".")
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (127.0.0.1: this machine only).")
    flags.DEFINE_integer("port", 8000, "TCP port.", lower_bound=0, upper_bound=65535)
    flags.DEFINE_string("served_model_name", None, "The model name clients send (default: the checkpoint "
                        "directory's name, or the preset name).")
    flags.DEFINE_string("api_key", None, f"A key every request but GET /health and GET /metrics must carry as "
                        f"'Authorization: Bearer KEY' (401 otherwise), as vLLM's --api-key; default: ${API_KEY_ENV} "
                        "where set (keeps the key off the command line), else none: the server is open.")
    flags.DEFINE_float("shutdown_timeout_s", 30.0, "Seconds active requests get on SIGINT/SIGTERM.", lower_bound=0.0)
    flags.DEFINE_boolean("warmup", True, "Compile before serving: the programs of --warmup_buckets and the decode "
                         "loop, one log line each (seconds) and a total line; until then GET /health answers 503 "
                         "{\"status\": \"warming up\"} and requests 503 (code warming_up). --nowarmup: each "
                         "program compiles inside the first request that needs it (logged as 'compiled while "
                         "serving').")
    flags.DEFINE_integer("warmup_threads", 0, "Programs the warm-up compiles at once (one device; under --tp one "
                         "at a time): it first traces every program and compiles them on this many threads, then "
                         "runs each once. 0 = half the usable CPUs, at most 8; 1 = one program at a time.",
                         lower_bound=0)
    flags.DEFINE_list("warmup_buckets", ["all"], "With --warmup: the prompt buckets to compile (prompts are padded to "
                      "a power of two >= 16 tokens; each bucket is a 1-row prefill and a --prefill_batch-row prefill, "
                      "or with the prefix cache its pass programs). 'all' (default): every bucket up to max_model_len, "
                      "so no request compiles; at 27B shapes this takes minutes (--compile_cache makes a later start "
                      "load them from disk). Or a list such as 16,32,64 (a number is rounded up to its bucket) for "
                      "a quicker start: a prompt of another bucket then compiles in its first request, logged with "
                      "its seconds.")
    flags.DEFINE_string("profile_dir", "", "Directory for device traces: POST /start_profile begins a JAX "
                        "profiler trace, POST /stop_profile writes it there (empty: both endpoints answer 400).")
    flags.DEFINE_string("log_level", "info", "uvicorn log level.")
    cli_help.define_model_flags()


def build(argv) -> tuple:
    """Model, engine and app from the flags (also used by tests)."""
    import qmtp
    from qmtp.runtime import compile_cache
    from qmtp.serve import round_costs
    from qmtp.serve.engine import Engine
    from qmtp.serve.engine_config import EngineConfig
    if len(argv) > 1:
        raise ValueError(f"unexpected positional arguments {argv[1:]}")
    if not FLAGS.checkpoint:
        raise ValueError("--checkpoint is required (a checkpoint directory or preset:tiny)")
    try:
        stop = None if FLAGS.stop_token_ids is None else tuple(int(t) for t in FLAGS.stop_token_ids if t)
    except ValueError:
        raise ValueError(f"--stop_token_ids={','.join(FLAGS.stop_token_ids)}: expected integers") from None
    cli_help.apply_compile_cache_flag()
    path = resolve_checkpoint(FLAGS.checkpoint, FLAGS.num_layers)
    model = qmtp.load(path, dtype=FLAGS.dtype, page_size=FLAGS.page_size, impl=FLAGS.impl, tp=FLAGS.tp,
                      fp8_act_quant=FLAGS.fp8_act_quant, deterministic=FLAGS.deterministic,
                      prefill_chunk=FLAGS.prefill_chunk, progress=False, draft_head=FLAGS.draft_head,
                      draft_vocab=FLAGS.draft_vocab)
    same_named = {f.name: FLAGS[f.name].value for f in dataclasses.fields(EngineConfig)
                  if f.name not in ("stop_token_ids", "round_cost_dir")}
    same_named["mtp_k"] = cli_help.mtp_k_from_flag(FLAGS.mtp_k)
    same_named["prefix_cache_bytes"] = cli_help.bytes_or_auto_from_flag("prefix_cache_bytes", FLAGS.prefix_cache_bytes)
    if not FLAGS["mtp_k"].present and model.cfg.mtp_layers != 1:
        print(f"{path}: no MTP layer (mtp_num_hidden_layers={model.cfg.mtp_layers}): plain decoding", file=sys.stderr,
              flush=True)
        same_named["mtp_k"] = 0
    cache = compile_cache.resolve(FLAGS.compile_cache)  # auto's round costs are kept beside compiled programs
    engine = Engine(model, EngineConfig(stop_token_ids=stop, round_cost_dir=cache and os.path.join(
        cache, round_costs.SUBDIR), **same_named))
    warning = cli_help.verify_rows_warning(model, FLAGS.batch_slots, engine.k, unit="batch slots")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    name = FLAGS.served_model_name or (FLAGS.checkpoint.split(":")[1] if FLAGS.checkpoint.startswith(PRESET_PREFIX)
                                       else os.path.basename(os.path.normpath(path)))
    defaults = sampling_defaults.from_checkpoint(path) if FLAGS.generation_config == "auto" else {}
    print(sampling_defaults.describe(defaults), file=sys.stderr, flush=True)
    reasoning_parser, why_reasoning = reasoning.resolve(FLAGS.reasoning_parser, model.tokenizer)
    tool_parser, why_tools = tool_calls.resolve(FLAGS.tool_call_parser, ChatTemplate.from_checkpoint(path).source)
    print(f"chat replies: reasoning parser {reasoning_parser} ({why_reasoning}), tool call parser {tool_parser} "
          f"({why_tools})", file=sys.stderr, flush=True)
    api_key = FLAGS.api_key if FLAGS.api_key is not None else os.environ.get(API_KEY_ENV, "")
    if api_key:
        print("requests need the API key (Authorization: Bearer ...)", file=sys.stderr, flush=True)
    settings = ServerSettings(name, FLAGS.max_tokens_limit, FLAGS.default_max_tokens, FLAGS.shutdown_timeout_s,
                              FLAGS.profile_dir, defaults, reasoning_parser, tool_parser, api_key)
    return model, engine, create_app(engine, settings)


def warmup_buckets(engine, values: list[str]) -> list[int]:
    """The prompt buckets --warmup_buckets names: 'all' = engine.prompt_buckets(), else positive integers;
    ValueError for other text or a bucket no request can reach (before anything starts)."""
    from qmtp.serve.warmup import plan
    if [v.strip().lower() for v in values] == ["all"]:
        return engine.prompt_buckets()
    try:
        buckets = [int(v) for v in values]
    except ValueError:
        buckets = [0]
    if not buckets or min(buckets) < 1:
        raise ValueError(f"--warmup_buckets={','.join(values)}: expected 'all' or positive integers such as 16,32,64")
    plan(engine, buckets)
    return buckets


def main(argv):
    from qmtp.model.checkpoint import CheckpointError
    from qmtp.model.config import ConfigError
    from qmtp.runtime import compile_cache
    try:
        _, engine, app = build(argv)
        buckets = warmup_buckets(engine, FLAGS.warmup_buckets) if FLAGS.warmup else None
        cache = compile_cache.resolve(FLAGS.compile_cache)
        print(f"serving {engine.model.checkpoint_dir} on http://{FLAGS.host}:{FLAGS.port} "
              f"(mtp_k={engine.config.mtp_k}, {engine.config.batch_slots} slots, "
              f"max_model_len={engine.max_model_len}); compile cache: {cache or 'off'}", flush=True)
        # the engine thread warms up while uvicorn starts: /health answers 503 "warming up" meanwhile (the
        # app's lifespan start() is then a no-op)
        engine.start(warmup_buckets=buckets)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    Server(app, engine, FLAGS.host, FLAGS.port, FLAGS.shutdown_timeout_s, FLAGS.log_level).uvicorn.run()
    if not engine.stop(FLAGS.shutdown_timeout_s):
        print("error: the engine did not stop in time", file=sys.stderr)
        sys.exit(1)


def cli() -> None:
    define_flags()
    cli_help.run(main, __doc__, __name__)


if __name__ == "__main__":
    cli()
