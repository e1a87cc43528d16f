"""A request's sampling arguments checked and turned into device rows (SamplingParams): the checks are
the same for qmtp.generate, its command line and the server, so a value out of range gets one message
naming it wherever it comes from."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from qmtp.runtime.sampling import MAX_BIAS, MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS, SamplingParams


def sampling_params(batch: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    seed=None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias=None,
                    vocab_size: int | None = None, min_tokens: int = 0, repetition_penalty: float = 1.0,
                    allowed_token_ids=None) -> SamplingParams | None:
    """Every row's SamplingParams (None: greedy without penalties, logit bias or min_tokens); ValueError
    naming a value out of range. seed: an int for every row, one per row, or None: a random one (the
    tokens then differ run to run). logit_bias: {token id: bias} (ids below vocab_size where given).
    min_tokens: the tokens generated before a stop id may end the row (0: off). repetition_penalty: > 0,
    1: off (qmtp/runtime/sampling.py). allowed_token_ids (vLLM's): the only ids the row may produce (None:
    all), at most MAX_LOGIT_BIAS; logit_bias then applies to those among them."""
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k={top_k} must be an integer >= 0 (0: off)")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p={min_p} must be in [0, 1]")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ValueError(f"{name}={value} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0: off)")
    if not 0 < repetition_penalty < float("inf"):
        raise ValueError(f"repetition_penalty={repetition_penalty} must be > 0 (1: off)")
    if not isinstance(min_tokens, (int, np.integer)) or isinstance(min_tokens, bool) or min_tokens < 0:
        raise ValueError(f"min_tokens={min_tokens!r} must be an integer >= 0 (0: off)")
    if allowed_token_ids is not None:
        logit_bias = allowed_bias(allowed_token_ids, logit_bias, vocab_size)
    bias_ids, bias = logit_bias_row(logit_bias, vocab_size)
    seeds = np.random.default_rng().integers(2 ** 32, size=batch) if seed is None else np.broadcast_to(
        np.asarray(seed, np.int64), (batch,))
    if seeds.min() < 0 or seeds.max() >= 2 ** 32:
        raise ValueError(f"seed={seed} must be in [0, 2^32)")
    if (temperature == 0 and presence_penalty == 0 and frequency_penalty == 0 and repetition_penalty == 1
            and not logit_bias and not min_tokens and allowed_token_ids is None):
        return None
    full = lambda x, dt: jnp.full((batch,), x, dt)  # noqa: E731
    rows = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape)  # noqa: E731
    return SamplingParams(full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
                          full(min_p, jnp.float32), jnp.asarray(seeds, jnp.uint32),
                          full(presence_penalty, jnp.float32), full(frequency_penalty, jnp.float32), rows(bias_ids),
                          rows(bias), full(min_tokens, jnp.int32), full(repetition_penalty, jnp.float32),
                          full(allowed_token_ids is not None, bool))


def allowed_bias(allowed_token_ids, logit_bias, vocab_size: int | None = None) -> dict:
    """The logit bias of a row that allows only allowed_token_ids (a non-empty list of ids): a bias for each
    of them, the request's where it gives one (else 0), none for other ids (they get -inf); ValueError naming
    allowed_token_ids when it is empty, holds a bad id or more than MAX_LOGIT_BIAS ids."""
    allowed = list(dict.fromkeys(allowed_token_ids))
    if not allowed or len(allowed) > MAX_LOGIT_BIAS:
        raise ValueError(f"allowed_token_ids={len(allowed)} ids: from 1 to {MAX_LOGIT_BIAS}")
    bad = [t for t in allowed if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0
           or (vocab_size is not None and t >= vocab_size)]
    if bad:
        bound = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"allowed_token_ids={bad[0]!r}: a token id must be an integer {bound}")
    bias = {int(k): v for k, v in (logit_bias or {}).items()}
    return {int(t): bias.get(int(t), 0.0) for t in allowed}


def logit_bias_row(logit_bias, vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """{token id: bias} (None: none) -> SamplingParams' row (ids [MAX_LOGIT_BIAS] int32, -1 past the
    given ones; biases [MAX_LOGIT_BIAS] f32); ValueError naming what is out of range."""
    items = list((logit_bias or {}).items())
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias={len(items)} ids: at most {MAX_LOGIT_BIAS}")
    ids, bias = np.full(MAX_LOGIT_BIAS, -1, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32)
    for i, (token, value) in enumerate(items):
        token = int(token)
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"logit_bias={token}: a token id must be {bound}")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise ValueError(f"logit_bias={value} (token {token}) must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        ids[i], bias[i] = token, value
    return ids, bias


def check_logprobs(logprobs) -> None:
    """ValueError unless logprobs is None (off) or an int in 0 .. MAX_TOP_LOGPROBS (alternatives per token)."""
    if logprobs is not None and (not isinstance(logprobs, (int, np.integer)) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ValueError(f"logprobs={logprobs!r} must be an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives "
                         "per token; None: off)")
