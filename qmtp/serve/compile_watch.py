"""The XLA compiles a block of code causes on the calling thread, from JAX's own monitoring events.

Why: a request whose shape the warm-up did not cover compiles inside the engine's scheduling point,
and every slot waits for it (seconds on the CPU, minutes at 27B). The engine wraps each device call
in `watch()` and logs any compile with its duration, so a slow request is never a silent one.

JAX reports every backend compile, and every load from its persistent compilation cache, as the
duration event BACKEND_COMPILE_EVENT with the jitted function's name. The listener is registered
for the length of the block only (JAX keeps listeners in a process-wide list) and keeps the events
of the thread that opened the block: another thread of the process compiles for someone else.
"""

from __future__ import annotations

import contextlib
import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


@contextlib.contextmanager
def watch():
    """Yields a list that receives (function name, seconds) for each compile on this thread in the block."""
    compiles: list[tuple[str, float]] = []
    thread = threading.get_ident()

    def listener(event: str, seconds: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT and threading.get_ident() == thread:
            compiles.append((str(kwargs.get("fun_name", "?")), seconds))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
