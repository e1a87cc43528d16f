"""XLA settings qmtp's programs are built for, added to XLA_FLAGS when qmtp is imported.

XLA reads XLA_FLAGS once, when JAX starts a backend (the first computation, not `import jax`), so
importing qmtp before anything runs is enough; a flag the user's XLA_FLAGS already names is left
as the user set it (`--xla_gpu_dot_merger_threshold_mb=32` restores XLA's default).

    xla_gpu_dot_merger_threshold_mb=0
        XLA's GPU DotMerger pass turns dots that share an operand into one dot against the
        concatenation of their other operands. With weights as those operands, the concatenation is
        a copy of the weights on every call, inside the decode loop. In the 27B verify pass (4 rows) it
        merged each GDN layer's in_proj_a and in_proj_b: per layer one `wrapped_concatenate` launch
        (2.2 us), one gemm and two `wrapped_slice` launches (1.2 us each) that the one-row step does
        not have, ~0.2 ms of a 9.9 ms verify (H200, session 9, scripts/round_pieces.py launch kinds).
        Weights never change between calls here, so a merge can only copy them; 0 turns the pass off.
"""

from __future__ import annotations

import os

DEFAULT_XLA_FLAGS = {"xla_gpu_dot_merger_threshold_mb": "0"}


def with_defaults(xla_flags: str) -> str:
    """`xla_flags` (an XLA_FLAGS value) with each DEFAULT_XLA_FLAGS entry it does not name appended."""
    named = {f.lstrip("-").split("=", 1)[0] for f in xla_flags.split()}
    extra = [f"--{name}={value}" for name, value in DEFAULT_XLA_FLAGS.items() if name not in named]
    return " ".join([xla_flags.strip()] * bool(xla_flags.strip()) + extra)


def apply(environ=os.environ) -> str:
    """Sets environ["XLA_FLAGS"] to with_defaults of its value; returns the new value."""
    environ["XLA_FLAGS"] = with_defaults(environ.get("XLA_FLAGS", ""))
    return environ["XLA_FLAGS"]
