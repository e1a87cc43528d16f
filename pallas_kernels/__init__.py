"""Pallas GPU kernels, each with a pure-jnp `_ref` twin (one file per kernel family; no qmtp imports)."""

# Imported up front, not left to Pallas's interpret mode (the CPU path) to import on its first call: it
# defines a JAX config option, which changes the tracing context, so every program traced before that
# call misses JAX's caches once and is traced and compiled again (CPU, tiny bf16 model, a second
# qmtp.generate of a prompt of the same shape: 6.7 s recompiling its prefill, against 0.6 s without the recompile).
import jax.experimental.pallas.fuser  # noqa: F401
