"""The serving engine's settings (`EngineConfig`) and the limits a request is checked against
(`RequestLimits`: each refusal a RequestError naming the field and the limit)."""

from __future__ import annotations

import dataclasses

from qmtp import api
from qmtp.runtime import loop
from qmtp.serve.requests import RequestError

DEFAULT_MAX_MODEL_LEN = 4096  # max_model_len 0: this, or less where the model's positions end sooner
DEFAULT_PREFIX_BLOCK = 64  # until measured on the GPU: a short system prompt still fills whole blocks
# prefix_cache_bytes "auto": the checkpoints' states take at most this share of the device memory free when the
# engine is built, until the warm-up measures what serving needs (warmup.py); where the device reports no
# memory (the CPU), AUTO_PREFIX_STATE_BYTES. Their KV pages are bounded by the pool (admission evicts).
AUTO_PREFIX_STATE_SHARE = 0.5
AUTO_PREFIX_STATE_BYTES = 1 << 30
# A long prompt's pass while other slots decode (H100, 27B-shaped FP8, 4 plain streams, a 32k prompt,
# `gpu_check.sh serve_long`, one machine): at 128 tokens the streams' gaps are p50 65.6 / p99 129.1 ms
# (1.97x) and the prompt's first token comes after 28.3 s; at 256, 65.3 / 149.8 ms (2.29x) and 18.6 s; at
# the 2048-token chunk each gap waits for a whole chunk (~0.3 s). 128 keeps the streams' p99 within 2x
# their median, at 6.5x the prompt's time alone (4.3 s).
DEFAULT_INTERLEAVE_PIECE = 128


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    batch_slots: int = 4  # B: requests decoded together
    mtp_k: int | str = 0  # drafts per round, 0 (plain) .. 4, or "auto" (chosen per round, adaptive_k.py)
    rounds_per_call: int = 4  # MTP rounds (or plain steps) per device call between scheduling points
    max_model_len: int = 0  # prompt + max_tokens limit; 0 = min(4096, max_position_embeddings - (K+1))
    num_pages: int = 0  # KV pages in the pool; 0 = every slot can hold a max_model_len request
    max_queue: int = 64  # queued (not yet admitted) requests beyond which submit() raises QueueFull
    max_stop_ids: int = 8  # stop token ids per request (device-side, NS)
    prefix_cache_bytes: int | str = api.AUTO  # prefix cache checkpoints and the KV pages only it holds; 0 = off
    prefix_block: int = 0  # tokens per prefix cache block; 0 = DEFAULT_PREFIX_BLOCK (prefill_chunk if deterministic)
    stop_token_ids: tuple[int, ...] | None = None  # default stop ids (None: the checkpoint's eos ids)
    interleave_piece: int = 0  # tokens of a prompt's prefill pass while other slots decode; 0 = the default
    prefill_batch: int = 4  # prompts of one bucket admitted together are prefilled in one pass (1: one by one)
    max_prefill_tokens: int = 8192  # rows x bucket of one batched prefill at most
    round_cost_dir: str | None = None  # mtp_k "auto": round costs kept here (round_costs.py); None: timed each start
    warmup_threads: int = 0  # programs the warm-up compiles at once; 0 = half the usable CPUs, at most 8

    def validate(self) -> None:
        if self.mtp_k != api.AUTO and not (isinstance(self.mtp_k, int) and 0 <= self.mtp_k <= loop.MAX_K):
            raise ValueError(f"--mtp_k={self.mtp_k}: supported 0..{loop.MAX_K} or {api.AUTO!r}")
        for name, low in (("batch_slots", 1), ("rounds_per_call", 1), ("max_model_len", 0),
                          ("num_pages", 0), ("max_queue", 1), ("max_stop_ids", 1), ("prefill_batch", 1),
                          ("max_prefill_tokens", 1), ("prefix_block", 0), ("interleave_piece", 0),
                          ("warmup_threads", 0)):
            value = getattr(self, name)
            if value < low:
                raise ValueError(f"--{name}={value} must be >= {low}")
        if self.prefix_cache_bytes != api.AUTO and not (isinstance(self.prefix_cache_bytes, int)
                                                        and self.prefix_cache_bytes >= 0):
            raise ValueError(f"--prefix_cache_bytes={self.prefix_cache_bytes}: a byte count >= 0 (0 = off) or "
                             f"{api.AUTO!r}")


def prefix_cache_budget(config: EngineConfig, pool_bytes: int, headroom: int | None) -> tuple[int, int | None]:
    """The prefix cache's (budget_bytes, state_limit) as the engine is built: --prefix_cache_bytes and no state
    limit until the warm-up sets one; under "auto", the KV pool's bytes plus the states' limit,
    AUTO_PREFIX_STATE_SHARE of the device memory free now (headroom: None where the device reports none:
    AUTO_PREFIX_STATE_BYTES)."""
    if config.prefix_cache_bytes != api.AUTO:
        return config.prefix_cache_bytes, None
    states = AUTO_PREFIX_STATE_BYTES if headroom is None else int(headroom * AUTO_PREFIX_STATE_SHARE)
    return pool_bytes + states, states


def prefix_block(config: EngineConfig, model: api.Model) -> int:
    """The prefix cache's block: --prefix_block, or its default; ValueError when it cannot work."""
    chunk, deterministic = model.kernels.prefill_chunk, model.kernels.deterministic
    block = config.prefix_block or (chunk if deterministic else max(DEFAULT_PREFIX_BLOCK, model.page_size))
    if block % model.page_size or block & (block - 1) or block > chunk:
        raise ValueError(f"--prefix_block={block} must be a power of two, a multiple of --page_size="
                         f"{model.page_size} and at most --prefill_chunk={chunk}")
    if deterministic and block != chunk:
        raise ValueError(f"--prefix_block={block}: under --deterministic it is --prefill_chunk={chunk} (a resumed "
                         "prefill then runs the same whole-chunk passes as a full one)")
    return block


def interleave_piece(config: EngineConfig, model: api.Model) -> int:
    """The most prompt tokens one prefill pass takes while other slots decode: --interleave_piece, or
    DEFAULT_INTERLEAVE_PIECE (at most --prefill_chunk; under --deterministic the chunk); ValueError when
    it cannot work (it is a prompt bucket: one more program at most)."""
    chunk = model.kernels.prefill_chunk
    piece = config.interleave_piece or (chunk if model.kernels.deterministic else min(DEFAULT_INTERLEAVE_PIECE, chunk))
    if piece & (piece - 1) or not api.MIN_PROMPT_BUCKET <= piece <= chunk:
        raise ValueError(f"--interleave_piece={piece} must be a power of two from {api.MIN_PROMPT_BUCKET} to "
                         f"--prefill_chunk={chunk}")
    if model.kernels.deterministic and piece != chunk:
        raise ValueError(f"--interleave_piece={piece}: under --deterministic a prompt is prefilled in whole chunks "
                         f"of --prefill_chunk={chunk} (its numbers then do not depend on the other requests)")
    return piece


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of an engine built for a model."""

    vocab_size: int
    max_model_len: int  # prompt + max_tokens
    page_size: int
    num_pages: int  # the KV page pool
    extra: int  # positions a verify writes past the committed length (K + 1, or 0 when plain)
    max_stop_ids: int
    has_tokenizer: bool  # stop strings need one

    def check(self, prompt_ids, max_tokens, stop_token_ids, stop) -> list[int]:
        """The prompt as a list of ints, or RequestError naming the field and the limit."""
        vocab, limit = self.vocab_size, self.max_model_len
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab})", "prompt")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens={max_tokens} must be an integer >= 1", "max_tokens")
        if len(ids) >= limit:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context limit is max_model_len={limit} "
                               "tokens (prompt + completion, --max_model_len)", "prompt", "context_length_exceeded")
        if len(ids) + max_tokens > limit:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                               f"exceeds the context limit max_model_len={limit} (--max_model_len)",
                               "max_tokens", "context_length_exceeded")
        need = -(-(len(ids) + max_tokens + self.extra) // self.page_size)
        if need > self.num_pages:
            raise RequestError(f"the request needs {need} KV pages of {self.page_size} tokens but the cache has "
                               f"only {self.num_pages} pages (--num_pages)", "max_tokens", "context_length_exceeded")
        if stop_token_ids is not None:
            stop_ids = [int(t) for t in stop_token_ids]
            if len(stop_ids) > self.max_stop_ids:
                raise RequestError(f"{len(stop_ids)} stop token ids > the limit of {self.max_stop_ids} "
                                   "(--max_stop_ids)", "stop_token_ids")
            if any(not 0 <= t < vocab for t in stop_ids):
                raise RequestError(f"stop token ids must be in [0, {vocab})", "stop_token_ids")
        if stop and not self.has_tokenizer:
            raise RequestError("stop strings need a tokenizer (the checkpoint has no tokenizer.json)", "stop")
        if any(not isinstance(x, str) or not x for x in stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        return ids
