"""qmtp: a JAX + Pallas inference engine for Qwen3.5 / Qwen3-Next hybrid models with MTP decoding."""

from qmtp.api import generate, GenerationResult, load, Model, mtp_logits, MtpLogits, target_logits, TokenLogprob
from qmtp.sampling_args import sampling_params
from qmtp.scoring import score

__all__ = ["GenerationResult", "Model", "MtpLogits", "TokenLogprob", "generate", "load", "mtp_logits",
           "sampling_params", "score", "target_logits"]
