"""The public Python API: load a checkpoint, generate (greedy or sampled), read teacher-forced logits.

    model = qmtp.load("path/to/checkpoint", dtype="bfloat16")
    result = qmtp.generate(model, ["def fibonacci("], max_new_tokens=32)
    result = qmtp.generate(model, ["def fibonacci("], mtp_k=3, temperature=0.6, top_p=0.95, seed=0, logprobs=5)
    logits = qmtp.target_logits(model, [1, 2, 3])          # numpy [T, V] float32
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from qmtp.model import fp8 as fp8_lib, load as load_lib, mtp, target as model_lib
from qmtp.model.config import ModelConfig
from qmtp.runtime import adaptive_k, loop, ops, prefill, tp as tp_lib
from qmtp.runtime.compile_only import CompileRecorder
from qmtp.runtime.kernel_config import DEFAULT_PREFILL_CHUNK, KernelConfig
from qmtp.runtime.paging import CapacityError, PageAllocator
from qmtp.runtime.sampling import TokenLogprobs
from qmtp.runtime.state import init_state
from qmtp.sampling_args import check_logprobs, sampling_params

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
AUTO = "auto"  # mtp_k: the draft length chosen per round (qmtp/runtime/adaptive_k.py)
COST_ROUNDS = 16  # tokens per row of a run that measures a round's seconds at one K (mtp_k="auto")
MIN_PROMPT_BUCKET = 16  # prompts are right-padded to a power of two >= this (fewer recompiles)


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded checkpoint plus the options it runs with. Immutable; holds no decode state."""

    cfg: ModelConfig
    params: dict
    tokenizer: object | None  # tokenizers.Tokenizer, when the checkpoint has tokenizer.json
    checkpoint_dir: str
    dtype: str = "bfloat16"
    page_size: int = 16
    num_pages: int | None = None  # None: what each call needs, at its padded lengths (generate)
    kernels: KernelConfig = KernelConfig()
    mesh: object | None = None  # jax.sharding.Mesh over the "tp" axis when loaded with tp > 1

    @property
    def impl(self) -> str:
        return self.kernels.impl

    @property
    def tp(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    @property
    def device(self):
        """The one jax.Device the parameters live on; None under tensor parallelism (a mesh)."""
        return next(iter(jax.tree.leaves(self.params)[0].devices())) if self.mesh is None else None

    @property
    def draft_head(self) -> str:
        """What MTP drafts read for their logits: "fp8" (the copy load(draft_head=...) made) or "bf16"
        (the shared lm_head, or its rows of a draft vocabulary)."""
        return "fp8" if isinstance(self.params.get("mtp", {}).get("draft_head"), fp8_lib.Fp8Block) else "bf16"


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target (log_softmax of its logits at the request's
    temperature, 1 when greedy, before top_k / top_p / min_p) and the most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob), most likely first; as many as asked
    rank: int | None = None  # the token's place among all ids, 1 = the most likely (qmtp.score gives it)


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt (stop token included when one was hit)
    texts: list[str] | None  # decoded new tokens, when a tokenizer is available
    prompt_lengths: list[int]
    stats: dict  # ttft_s, decode_s, new_tokens, decode_tokens_per_s, steps, warmup_s; with MTP also
    # mtp_k, rounds, drafted, accepted, acceptance_rate, mean_accepted_length, accept_hist,
    # position_acceptance (share of rounds whose draft i was accepted)
    logprobs: list[list[TokenLogprob]] | None = None  # per prompt, one per token, when asked for


def token_logprobs(lp: TokenLogprobs, row: int, tokens: list[int]) -> list[TokenLogprob]:
    """Row `row` of TokenLogprobs arrays [B, T, ...] (numpy or device) for its first len(tokens) tokens."""
    n = len(tokens)
    chosen, ids, top = (np.asarray(x)[row, :n] for x in (lp.chosen, lp.top_ids, lp.top))
    return [TokenLogprob(t, float(c), list(zip(i.tolist(), v.tolist())))
            for t, c, i, v in zip(tokens, chosen, ids, top)]


@dataclasses.dataclass
class MtpLogits:
    logits: np.ndarray  # [T-1, V] f32: draft logits at p from (h_p, x_{p+1}), predicting x_{p+2}
    draft_argmax: np.ndarray  # [T-1]
    target_argmax: np.ndarray  # [T-1]: the target's own next-token argmax at p+1
    agreement: float  # mean(draft_argmax == target_argmax): top-1 acceptance of the first draft


def load(checkpoint_dir: str, dtype: str = "bfloat16", page_size: int = 16, num_pages: int | None = None,
         impl: str = "ref", progress: bool = True, tp: int = 1, converted_cache: str | None = None,
         draft_head: str = "auto", draft_vocab=None, fp8_act_quant: bool = False,
         deterministic: bool = False, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> Model:
    """Loads config, weights (strictly) and tokenizer from a Hugging Face checkpoint directory.

    tp > 1: tensor parallelism over the first `tp` devices; each device loads only its shard and every
    call runs as one shard_map over them (same tokens as tp = 1).

    converted_cache: a directory for an orbax cache of the read (and sharded) parameter tree
    (qmtp/model/converted_cache.py), keyed by the checkpoint files x dtype x tp: a hit skips the
    safetensors; an unreadable entry is reported and read again from the checkpoint.

    draft_head: "bf16" (drafts use the shared lm_head), "fp8" (an FP8 128x128-block copy made at load:
    half the bytes per draft step, 1.27 GB more memory at 27B) or "auto" ("fp8" for FP8 checkpoints).
    draft_vocab: None, or token ids (a file or a sequence; qmtp/model/draft_vocab.py) that drafts
    choose among, through the head's rows for them. Neither changes tokens (the verify pass keeps the
    exact lm_head); acceptance may drop.

    impl, fp8_act_quant, deterministic and prefill_chunk make the model's KernelConfig
    (qmtp/runtime/kernel_config.py): "ref" (pure XLA) or "pallas" (the Pallas kernels, FP8 weights in their
    tiles), E4M3 activations, row-invariant numerics (tokens independent of K and of the batch), and the
    prompt chunk a longer prompt is prefilled in."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: supported {sorted(DTYPES)}")
    if page_size <= 0 or (num_pages is not None and num_pages <= 0):
        raise ValueError(f"page_size={page_size} and num_pages={num_pages} must be positive")
    kernels = KernelConfig(impl, fp8_act_quant, deterministic, prefill_chunk)
    load_lib.check_draft_head(draft_head)
    mesh = tp_lib.make_mesh(tp) if tp != 1 else None
    cfg, params = load_lib.load_params(checkpoint_dir, dtype, kernels, mesh, progress=progress,
                                       converted_cache=converted_cache, draft_head=draft_head,
                                       draft_vocab=draft_vocab)
    return Model(cfg, params, _load_tokenizer(checkpoint_dir), checkpoint_dir, dtype, page_size, num_pages, kernels,
                 mesh)


def _load_tokenizer(checkpoint_dir: str):
    path = os.path.join(checkpoint_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise ValueError(f"{path}: cannot load tokenizer ({e})") from None


def encode(model: Model, prompts) -> list[list[int]]:
    """Text prompts -> token ids (through tokenizer.json); id lists pass through, validated."""
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError(f"prompt {i} is text but {model.checkpoint_dir} has no tokenizer.json; "
                                 "pass token ids instead")
            p = model.tokenizer.encode(p, add_special_tokens=False).ids
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < model.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} outside the vocabulary [0, {model.cfg.vocab_size})")
        ids.append(p)
    if not ids:
        raise ValueError("no prompts given")
    return ids


def _bucket(n: int) -> int:
    return max(MIN_PROMPT_BUCKET, 1 << (n - 1).bit_length())


def _new_state(model: Model, capacities: list[int], padded: int = 0):
    """Reserves pages for each sequence's capacity and returns a zero state with that page table. Unless
    the model fixes the pool (num_pages), each sequence gets at least `padded` positions (capped at
    max_position_embeddings), so calls of one padded shape share their programs."""
    limit = model.cfg.max_position_embeddings
    for b, c in enumerate(capacities):
        if c > limit:
            raise CapacityError(f"sequence {b} needs {c} positions > max_position_embeddings={limit}")
    if not model.num_pages:
        capacities = [max(c, min(padded, limit)) for c in capacities]
    pages_needed = [-(-c // model.page_size) for c in capacities]
    allocator = PageAllocator(model.num_pages or sum(pages_needed), model.page_size)
    handles = [allocator.reserve(c) for c in capacities]
    table = allocator.page_table(handles)
    if model.mesh is not None:
        return tp_lib.init_state(model.cfg, model.mesh, table, allocator.num_pages, model.page_size, DTYPES[model.dtype])
    return init_state(model.cfg, table, allocator.num_pages, model.page_size, DTYPES[model.dtype])


def _call(model: Model, fn, lead: tuple, args: tuple, kinds: tuple, out_kinds: tuple, **statics):
    """fn(*lead, *args, **statics) on one device, or as one shard_map over the model's mesh (tp.sharded);
    lead and statics are fn's static arguments."""
    if model.mesh is None:
        return fn(*lead, *args, **statics)
    return tp_lib.sharded(fn, model.mesh, lead, args, kinds, out_kinds, check_vma=not model.kernels.pallas,
                          statics=statics)


def _prompt_batch(prompt_ids: list[list[int]]):
    t = _bucket(max(len(p) for p in prompt_ids))
    tokens = np.zeros((len(prompt_ids), t), np.int32)
    for b, p in enumerate(prompt_ids):
        tokens[b, :len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompt_ids], jnp.int32)


def _cap_schedule(accept_cap, batch: int, k: int) -> jax.Array:
    """None (no cap) | int | [R] | [R, B] -> int32 [R', B] caps on accepted drafts per round."""
    if accept_cap is None:
        return jnp.full((1, batch), k, jnp.int32)
    cap = np.asarray(accept_cap, np.int32)
    if cap.ndim == 0:
        cap = np.full((1, batch), int(cap), np.int32)
    elif cap.ndim == 1:
        cap = np.repeat(cap[:, None], batch, axis=1)
    if cap.ndim != 2 or cap.shape[1] != batch or (cap < 0).any() or (cap > k).any():
        raise ValueError(f"accept_cap: expected ints in [0, {k}] shaped [] / [R] / [R, {batch}], got {cap.shape}")
    return jnp.asarray(cap)


def generate(model: Model, prompts, max_new_tokens: int = 32, stop_token_ids=None, mtp_k: int | str = 0,
             accept_cap=None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             seed: int | None = None, logprobs: int | None = None, warmup: bool = False,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias: dict | None = None,
             min_tokens: int = 0, repetition_penalty: float = 1.0, allowed_token_ids=None, progress=None,
             compile_only: bool = False) -> GenerationResult | None:
    """Generation for a batch of prompts (text or token-id lists), loop on the device: greedy at temperature 0, else
    sampled from the processed distribution (qmtp/runtime/sampling.py: temperature, top_k, top_p, min_p), after the
    OpenAI API's logit_bias ({token id: bias}, -100 .. 100), presence_penalty and frequency_penalty on the ids the
    sequence generated so far, and repetition_penalty (HF's and vLLM's: > 0, 1 = off) on those of its prompt and the
    ones it generated (greedy too: the argmax of the adjusted logits); allowed_token_ids (vLLM's; up to 300 ids):
    the only ids a sequence may produce. Keys come from (seed, position), so a seeded prompt gives the same tokens
    in any batch (seed None: a random seed). logprobs N (0 .. 20; None: off): each token's log-probability under the
    target and its N most likely alternatives (TokenLogprob), plain or MTP alike.

    mtp_k = 0: plain decoding; 1..4: MTP speculative decoding with K drafts per round (greedy: the same
    tokens; sampled: the same distribution, by speculative sampling); "auto": each round runs the K of
    adaptive_k.CANDIDATES with the most expected tokens per second, from the rows' recent acceptance
    and the seconds of a round at each K, measured first on this batch (one short run per K after the
    compile; stats k_rounds and round_cost_s say which ran and what they cost).
    Stops each sequence at a stop id (default: generation_config's eos ids) or after `max_new_tokens`;
    min_tokens (vLLM's): the stop ids get -inf until a sequence has generated that many tokens.
    `accept_cap` (MTP only; how benchmarks impose an acceptance profile, qmtp/bench/profile.py) caps
    the accepted drafts per round: an int, or a schedule [R] / [R, B] (round r uses row min(r, R-1));
    capping never changes the tokens. With warmup=True the compiled programs are built first (timed as
    warmup_s), so ttft_s / decode_s measure execution. `progress`: None, or a callable that is handed a
    line as each phase (compiling, generating) starts (qmtp.cli_progress.Phases prints them).
    compile_only=True (one device): compiles the call's programs without running them and returns None
    (qmtp/runtime/compile_only.py); several threads may do so at once, for other modes of one batch, and
    the calls then find their programs compiled."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    adaptive = mtp_k == AUTO
    if adaptive:
        mtp_k = adaptive_k.CANDIDATES[-1]
    elif not isinstance(mtp_k, (int, np.integer)):
        raise ValueError(f"mtp_k={mtp_k!r}: an integer 0..{loop.MAX_K} or {AUTO!r}")
    loop.check_k(mtp_k)
    check_logprobs(logprobs)
    if mtp_k:
        mtp.check_supported(model.cfg)
    prompt_ids = encode(model, prompts)
    batch = len(prompt_ids)
    ops.check_deterministic_rows(model.kernels, batch, mtp_k, "prompts x (mtp_k+1)")
    sampling = sampling_params(batch, temperature, top_k, top_p, min_p, seed, presence_penalty, frequency_penalty,
                               logit_bias, model.cfg.vocab_size, min_tokens, repetition_penalty, allowed_token_ids)
    if min_tokens > max_new_tokens:  # an integer >= 0 by now
        raise ValueError(f"min_tokens={min_tokens} must be <= max_new_tokens={max_new_tokens}")
    stop = loop.stop_rows(model.cfg.eos_token_ids if stop_token_ids is None else stop_token_ids, batch)
    # a round's pass writes K+1 positions past the committed length
    capacities = [len(p) + max_new_tokens + mtp_k + 1 for p in prompt_ids]
    tokens, n_valid = _prompt_batch(prompt_ids)
    # The loop's bound and the KV pool come from power-of-two buckets (of max_new_tokens, and of the prompt
    # as its tokens are padded): calls that differ only in those within a bucket share their compiled
    # programs (the loop stops at each row's budget of max_new_tokens either way).
    rounds = _bucket(max_new_tokens)
    padded = tokens.shape[1] + rounds + mtp_k + 1
    cap = _cap_schedule(accept_cap, batch, mtp_k) if mtp_k and accept_cap is not None else None
    statics = (model.cfg, model.kernels)
    device = model.device
    if compile_only and device is None:
        raise ValueError("compile_only: one device only (not under tensor parallelism)")
    call = CompileRecorder(lambda compile_: compile_(), device) if compile_only else _call

    def run(limit, round_cost=None):
        if compile_only:  # its shapes, committed to the device: no memory taken
            state = tp_lib.committed_shapes(jax.eval_shape(lambda: _new_state(model, capacities, padded)), device)
        else:
            state = _new_state(model, capacities, padded)
            if device is not None:  # committed, as the prefill's outputs are: one compiled loop for both (no copy)
                state = jax.device_put(state, device)
        budget = jnp.full((batch,), limit, jnp.int32)
        t0 = time.perf_counter()
        args, kinds = (model.params, state, tokens, n_valid, budget, stop), ("params", "state") + ("rep",) * 4
        if sampling is not None:
            args, kinds = args + (sampling,), kinds + ("rep",)
        first, slots, state, *first_lp = call(model, prefill.prefill, statics + (bool(mtp_k),), args, kinds,
                                               ("rep", "rep", "state") + ("rep",) * (logprobs is not None),
                                               top_logprobs=logprobs)
        first.block_until_ready()
        t1 = time.perf_counter()
        args, kinds = (model.params, state, slots), ("params", "state", "rep")
        if cap is not None or sampling is not None or adaptive:
            args, kinds = args + (cap, sampling), kinds + ("rep", "rep")
        if adaptive:
            args, kinds = args + (jnp.asarray(round_cost, jnp.float32),), kinds + ("rep",)
        out, count, stats, _, _, *lp = call(model, loop.decode, statics + (mtp_k, rounds), args, kinds,
                                             ("rep", "rep", "rep", "state", "rep") + ("rep",) * len(first_lp),
                                             top_logprobs=logprobs,
                                             **({"adaptive_ks": adaptive_k.CANDIDATES} if adaptive else {}))
        out.block_until_ready()
        lp = jax.tree.map(lambda a, b: np.concatenate([a, b], axis=1), *first_lp, *lp) if lp else None  # [B, 1 + W]
        return first, out, count, stats, t1 - t0, time.perf_counter() - t1, lp

    def measure_round_costs():
        """Seconds per round at each candidate K: a short run with each in turn forced (every other one
        given an enormous cost), the compiled loop's own program."""
        costs = []
        for c in range(len(adaptive_k.CANDIDATES)):
            _, _, _, stats, _, seconds, _ = run(min(max_new_tokens, COST_ROUNDS), adaptive_k.forcing(c))
            costs.append(seconds / max(int(np.asarray(stats["rounds"]).max(initial=0)), 1))
        return np.asarray(costs, np.float32)

    progress = progress or (lambda line: None)
    loop_name = (f"the adaptive MTP decode loop (K in {adaptive_k.CANDIDATES})" if adaptive else
                 f"the MTP K={mtp_k} decode loop" if mtp_k else "the plain decode loop")
    compiling = f"compiling prefill (batch {batch}, prompt bucket {tokens.shape[1]}) and {loop_name}"
    warmup_s, round_cost = 0.0, None
    if compile_only:
        progress(compiling)
        run(1, np.ones(len(adaptive_k.CANDIDATES)) if adaptive else None)
        return None
    if warmup or adaptive:  # "auto" times rounds: compiled first
        progress(compiling)
        t0 = time.perf_counter()
        run(1, np.ones(len(adaptive_k.CANDIDATES)) if adaptive else None)  # shapes do not depend on the budget
        if adaptive:
            progress(f"timing a round at K = {', '.join(map(str, adaptive_k.CANDIDATES))}")
            round_cost = measure_round_costs()
        warmup_s = time.perf_counter() - t0
    progress(f"generating up to {max_new_tokens} tokens for {batch} prompt{'s' if batch > 1 else ''}"
             if warmup or adaptive else f"{compiling}, then generating")
    first, out, count, stats, ttft, decode_s, lp = run(max_new_tokens, round_cost)
    first, out, count = np.asarray(first), np.asarray(out), np.asarray(count)
    new = [[int(first[b])] + out[b, :count[b]].tolist() for b in range(batch)]
    n_decoded = int(count.sum())
    texts = [model.tokenizer.decode(t, skip_special_tokens=True) for t in new] if model.tokenizer else None
    stats_out = {"ttft_s": ttft, "decode_s": decode_s, "warmup_s": warmup_s, "new_tokens": n_decoded + batch,
                 "decode_tokens_per_s": n_decoded / decode_s if decode_s > 0 else float("nan"),
                 "batch": batch, "mtp_k": AUTO if adaptive else mtp_k}
    stats_out.update(_mtp_stats(stats, mtp_k) if mtp_k else {"steps": int(np.asarray(stats["rounds"]).max(initial=0))})
    if adaptive:
        stats_out["k_rounds"] = dict(zip(adaptive_k.CANDIDATES, np.asarray(stats["k_rounds"]).tolist()))
        stats_out["round_cost_s"] = dict(zip(adaptive_k.CANDIDATES, round_cost.tolist()))
    lps = None if lp is None else [token_logprobs(lp, b, tokens) for b, tokens in enumerate(new)]
    return GenerationResult(new, texts, [len(p) for p in prompt_ids], stats_out, lps)


def _mtp_stats(extra: dict, k: int) -> dict:
    rounds, drafted, accepted = (int(np.asarray(extra[n]).sum()) for n in ("rounds", "drafted", "accepted"))
    pos = np.asarray(extra["position_accepts"])
    return {"steps": int(np.asarray(extra["rounds"]).max(initial=0)), "rounds": rounds, "drafted": drafted,
            "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else float("nan"),
            "mean_accepted_length": (accepted + rounds) / rounds if rounds else float("nan"),
            "accept_hist": np.asarray(extra["accept_hist"]).tolist(),
            "position_acceptance": (pos / rounds).tolist() if rounds else [float("nan")] * k}


def target_logits(model: Model, token_ids) -> np.ndarray:
    """Teacher-forced logits [T, V] (float32 numpy) of the target over one token sequence."""
    (ids,) = encode(model, [list(token_ids)])
    state = _new_state(model, [len(ids)])
    tokens = jnp.asarray([ids], jnp.int32)
    (logits,) = _call(model, _target_logits, (model.cfg, model.kernels), (model.params, state, tokens),
                      ("params", "state", "rep"), ("rep",))
    return np.asarray(logits, np.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels"))
def _target_logits(cfg, kernels, params, state, tokens):
    n = jnp.asarray([tokens.shape[1]], jnp.int32)
    hidden, _ = model_lib.forward(cfg, params, state, tokens, n, kernels)
    return (tp_lib.gather_vocab(model_lib.logits_from_hidden(params, hidden[0], kernels)),)  # [T, V]


@functools.partial(jax.jit, static_argnames=("cfg", "kernels"))
def _teacher_forced(cfg, kernels, params, state, tokens):
    n = jnp.asarray([tokens.shape[1]], jnp.int32)
    hidden, state = model_lib.forward(cfg, params, state, tokens, n, kernels)
    target = tp_lib.gather_vocab(model_lib.logits_from_hidden(params, hidden[0], kernels))  # [T, V]
    # MTP at positions 0..T-2 from (x_{p+1}, h_p)
    mh, _ = mtp.forward(cfg, params, state, tokens[:, 1:], hidden[:, :-1], jnp.zeros((1,), jnp.int32), n - 1,
                        kernels)
    draft = tp_lib.gather_vocab(model_lib.draft_logits(params, mh[0], kernels))  # [T-1, V] or [T-1, Vs']
    vocab = params["mtp"].get("draft_vocab")
    if vocab is not None:  # a draft vocabulary: its ids get their logits, every other id -inf
        full = jnp.full((draft.shape[0], target.shape[-1]), -jnp.inf, draft.dtype)
        draft = full.at[:, vocab].max(draft)  # a padding repeat of an id keeps the larger of its two
    return target, draft


def mtp_logits(model: Model, token_ids) -> MtpLogits:
    """Teacher-forced MTP drafts: for each position p < T-1, the draft logits from the target's
    post-norm hidden h_p and the true next token x_{p+1} (predicting x_{p+2}), and their top-1
    agreement with the target's own argmax at p+1."""
    mtp.check_supported(model.cfg)
    (ids,) = encode(model, [list(token_ids)])
    if len(ids) < 2:
        raise ValueError("mtp_logits needs at least 2 tokens")
    state = _new_state(model, [len(ids)])
    target, draft = _call(model, _teacher_forced, (model.cfg, model.kernels),
                          (model.params, state, jnp.asarray([ids], jnp.int32)), ("params", "state", "rep"), ("rep", "rep"))
    target_next = np.asarray(jnp.argmax(target[1:], axis=-1))
    draft = np.asarray(draft, np.float32)
    draft_argmax = np.argmax(draft, axis=-1)
    return MtpLogits(draft, draft_argmax, target_next, float(np.mean(draft_argmax == target_next)))
