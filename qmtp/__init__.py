"""qmtp: a JAX + Pallas inference engine for Qwen3.5 / Qwen3-Next hybrid models with MTP decoding."""

from qmtp import xla_defaults

xla_defaults.apply()  # before any computation starts a backend (XLA reads XLA_FLAGS then)

from qmtp.api import GenerationResult, Model, MtpLogits, generate, load, mtp_logits, target_logits  # noqa: E402

__all__ = ["GenerationResult", "Model", "MtpLogits", "generate", "load", "mtp_logits", "target_logits"]
