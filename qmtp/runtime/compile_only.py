"""Programs compiled without running them: `CompileRecorder` stands in for api._call (its signature, one
device) while a caller's host code runs as if it made its device calls. Each program not seen yet is
traced and lowered on the calling thread and its compile handed to `submit`; the call returns the input
state for each "state" output and device zeros of the output's shape for the rest, so the host code goes
on to its next call with the shapes the real run would give it. JAX keeps a lowering's executable where
the jitted call looks it up, so the real run afterwards compiles nothing.

Users: the server's warm-up compiles its programs on a thread pool (qmtp/serve/warmup.py), and
qmtp.generate(compile_only=True) a generation's (the benchmark compiles every mode's at once). A program
compiled for uncommitted arguments is not the one a call with committed ones looks up: the zeros are
committed to `device`, and callers pass the state committed, as the real call's outputs are.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np


class CompileRecorder:
    """api._call's stand-in: compiles = {program key: what submit(compile) returned} (a future on a pool, or
    the compiled program where submit runs it at once)."""

    def __init__(self, submit: Callable, device: jax.Device):
        self.submit, self.device = submit, device
        self.compiles: dict = {}

    def __call__(self, model, fn, lead: tuple, args: tuple, kinds: tuple, out_kinds: tuple, **statics):
        traced = fn.trace(*lead, *args, **statics)
        key = (fn, lead, tuple(sorted(statics.items())), jax.tree.structure(args),
               tuple((a.shape, a.dtype) for a in jax.tree.leaves(traced.in_avals)))
        if key not in self.compiles:
            self.compiles[key] = self.submit(traced.lower().compile)
        state = args[kinds.index("state")] if "state" in kinds else None
        zeros = lambda s: jax.device_put(np.zeros(s.shape, s.dtype), self.device)  # noqa: E731  (committed)
        return tuple(state if kind == "state" else jax.tree.map(zeros, out)
                     for kind, out in zip(out_kinds, traced.out_info))
