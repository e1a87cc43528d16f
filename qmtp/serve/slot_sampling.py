"""Each batch slot's sampling parameters on the host, and a request's parameters checked at submission.

The engine hands the device the parameters of the slots a call covers as one SamplingParams (arrays
[n]): a prefill always (greedy rows at temperature 0 keep the argmax, so each bucket has one prefill
program), the decode loop only while some decoding slot samples or adjusts its logits (a penalty, a logit
bias, min_tokens, a repetition penalty; otherwise the loop's greedy form, which keeps no counts of generated ids).
"""

from __future__ import annotations

import numpy as np

from qmtp import sampling_args
from qmtp.runtime.sampling import MAX_LOGIT_BIAS, SamplingParams
from qmtp.serve.requests import RequestError

GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0, "presence_penalty": 0.0,
          "frequency_penalty": 0.0, "logit_bias_ids": -1, "logit_bias": 0.0, "min_tokens": 0, "repetition_penalty": 1.0,
          "only_listed": False}
DTYPES = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "min_p": np.float32, "seed": np.uint32,
          "presence_penalty": np.float32, "frequency_penalty": np.float32, "logit_bias_ids": np.int32,
          "logit_bias": np.float32, "min_tokens": np.int32, "repetition_penalty": np.float32, "only_listed": bool}
ROW_SHAPES = {"logit_bias_ids": (MAX_LOGIT_BIAS,), "logit_bias": (MAX_LOGIT_BIAS,)}  # a slot's [n] (others: a scalar)


def check(temperature, top_k, top_p, min_p, seed, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None,
          vocab_size=None, min_tokens=0, repetition_penalty=1.0, allowed_token_ids=None) -> dict | None:
    """A request's sampling parameters (None: greedy without penalties, logit bias or min_tokens; seed None:
    a random one), or RequestError naming the one out of range."""
    try:
        params = sampling_args.sampling_params(1, temperature, top_k, top_p, min_p, seed, presence_penalty,
                                               frequency_penalty, logit_bias, vocab_size, min_tokens,
                                               repetition_penalty, allowed_token_ids)
    except ValueError as e:
        raise RequestError(str(e), str(e).split("=")[0]) from None
    if params is None:
        return None
    return {name: np.asarray(getattr(params, name))[0] for name in GREEDY}  # the one row's values


class SlotSampling:
    """The parameters of B slots, host columns [B] or [B, n] (SamplingParams' fields)."""

    def __init__(self, batch_slots: int):
        self.batch_slots = batch_slots
        self.columns = {k: np.full((batch_slots,) + ROW_SHAPES.get(k, ()), v, DTYPES[k]) for k, v in GREEDY.items()}

    def set(self, slot: int, sampling: dict | None) -> None:
        """A newly admitted request's parameters (None: greedy) for its slot."""
        for name, column in self.columns.items():
            column[slot] = (sampling or GREEDY)[name]

    def any_sampled(self, slots) -> bool:
        """Whether any of these slots samples or adjusts its logits (needs the loop's sampled form)."""
        return bool(np.any(_needs_params(self.columns, list(slots))))

    def rows(self, slots, always: bool = False) -> SamplingParams | None:
        """The parameters of these slots (an id past the last slot: a greedy padding row); None, unless
        `always`, when all of them are greedy."""
        ids = np.asarray(list(slots), np.int64)
        real = ids < self.batch_slots
        cols = {k: np.where(real.reshape((-1,) + (1,) * (v.ndim - 1)), v[np.where(real, ids, 0)],
                            v.dtype.type(GREEDY[k])) for k, v in self.columns.items()}
        if not (always or np.any(_needs_params(cols, slice(None)))):
            return None
        return SamplingParams(**cols)


def _needs_params(cols: dict, rows):
    """[n] bool: the rows that sample, have a penalty (repetition too), a logit bias, min_tokens or allowed ids."""
    return ((cols["temperature"][rows] > 0) | (cols["presence_penalty"][rows] != 0)
            | (cols["frequency_penalty"][rows] != 0) | (cols["repetition_penalty"][rows] != 1)
            | np.any(cols["logit_bias_ids"][rows] >= 0, axis=-1) | (cols["min_tokens"][rows] > 0)
            | cols["only_listed"][rows])
