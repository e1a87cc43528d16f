"""qmtp.generate(compile_only=True): a generation's programs compiled without running them, from several
threads at once (how the benchmark compiles its modes), after which the generations compile nothing."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

import qmtp
from qmtp.serve import compile_watch
from qmtp.tools.make_checkpoint import resolve_checkpoint


def test_programs_compiled_on_threads_are_the_ones_the_calls_run():
    model = qmtp.load(resolve_checkpoint("preset:tiny"), dtype="float32", progress=False)
    prompts = np.random.default_rng(3).integers(0, 380, (2, 20)).tolist()
    cap = np.full((9, 2), 1, np.int32)  # a schedule: the loop of a capped K=2 run
    modes = [dict(mtp_k=0), dict(mtp_k=2, accept_cap=cap)]
    with concurrent.futures.ThreadPoolExecutor(len(modes)) as pool:
        assert [f.result() for f in [pool.submit(qmtp.generate, model, prompts, max_new_tokens=8, compile_only=True,
                                                 **mode) for mode in modes]] == [None, None]
    for mode in modes:
        with compile_watch.watch() as compiles:
            result = qmtp.generate(model, prompts, max_new_tokens=8, **mode)
        # the state's zeros (small XLA ops, not the prefill or the loop) compile on their first use
        assert not [name for name, _ in compiles if "prefill" in name or "decode" in name], compiles
        assert len(result.tokens) == 2


def test_compile_only_takes_one_device():
    model = qmtp.load(resolve_checkpoint("preset:tiny"), dtype="float32", progress=False, tp=2)
    with pytest.raises(ValueError, match="compile_only: one device only"):
        qmtp.generate(model, [[1, 2, 3]], max_new_tokens=2, compile_only=True)
