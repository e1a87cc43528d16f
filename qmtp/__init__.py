"""qmtp: a JAX + Pallas inference engine for Qwen3.5 / Qwen3-Next hybrid models with MTP decoding."""

from qmtp.api import (generate, GenerationResult, load, Model, mtp_logits, MtpLogits, sampling_params, target_logits,
                      TokenLogprob)

__all__ = ["GenerationResult", "Model", "MtpLogits", "TokenLogprob", "generate", "load", "mtp_logits",
           "sampling_params", "target_logits"]
