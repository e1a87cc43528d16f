"""The serving engine's warm-up: every program a request can call, as steps planned and run before serving.

Why: a program first called inside a scheduling point compiles there, and every slot waits for it
(the tiny test model on the CPU, after a warm-up of bucket 16 only: a 20-token prompt took 7.6 s, 6.5 s
of it compiling its prefill; at 27B shapes a compile takes tens of seconds). Prompts are right-padded
to power-of-two buckets (api._bucket, >= 16 tokens) up to the bucket of the longest prompt the limits
admit (Engine.prompt_buckets), and each bucket has its own programs (qmtp/serve/slots.py): a prefill
of one row; a batched prefill of `_group_rows(bucket)` rows when two of its prompts fit in the page
pool together (with the prefix cache: the passes of each width, one row and batched, a checkpoint and
a resume). Buckets above the model's prefill_chunk are prefilled piece by piece: one program for all
of them (qmtp/serve/prompt_passes.py), and one more for the smaller pieces of --interleave_piece
(prompts above it while other requests decode). Then the decode loop, its sampled form (run while any
slot samples), the sampled form that returns logprobs (while any slot asks for them) and the
slot-retire op of a cancelled request.

Each step drives the engine's own admission code on dummy requests (id -1; max_tokens 1: the first
token finishes them), so the shapes are exactly those of serving; this module
reaches into Engine's private methods for that reason. The seconds a step logs are its compile (or its
load from JAX's persistent compilation cache, --compile_cache) and one run.

With more than one compile thread (--warmup_threads; single device) the steps first run once with
their device calls recorded instead of made (`precompile`): each new program is traced and lowered on
the calling thread (Python) and compiled on a pool thread (XLA's compile releases the GIL), its
outputs stood in for by zeros of their shapes, the state passed through unchanged. The steps then run
for real, serially, and find every program compiled: JAX keeps a lowering's executable where the
jitted call looks it up.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time
from typing import Callable

import numpy as np

from qmtp import api
from qmtp.runtime import adaptive_k
from qmtp.runtime.compile_only import CompileRecorder
from qmtp.serve.prompt_passes import LONG_PROMPTS
from qmtp.serve import round_costs
from qmtp.serve.requests import RequestHandle


MAX_COMPILE_THREADS = 8  # warm-up compiles at once by default (each holds a few GB of host memory at 27B)
PREFIX_STATE_MARGIN = 0.1  # of the device memory the warm-up left: kept free of prefix cache states


@dataclasses.dataclass(frozen=True)
class Step:
    name: str  # the program, as the log line names it: "prompt bucket 64: prefill x 4 rows"
    run: Callable[[], None]
    bucket: int | None = None  # None: the decode loop or the piece prefill
    recordable: bool = True  # False: the step times or stores something, so precompile's dry pass skips it


def plan(engine, buckets) -> list[Step]:
    """The steps for these prompt lengths or buckets (each rounded up to its bucket), then the decode
    loop. ValueError for a bucket no request can reach (beyond engine.prompt_buckets())."""
    reachable = engine.prompt_buckets()
    chosen = sorted({api._bucket(int(n)) for n in buckets})
    beyond = [b for b in chosen if b > reachable[-1]]
    if beyond:
        raise ValueError(f"prompt bucket {beyond[0]} (--warmup_buckets) is beyond the largest a request can reach: "
                         f"{reachable[-1]} (prompts of at most {engine.longest_prompt()} tokens, --max_model_len="
                         f"{engine.max_model_len})")
    steps = []
    if engine.prefix is not None:
        steps += _prefix_steps(engine, chosen)
        chosen = []
    else:
        if any(b > engine.piece for b in chosen):
            steps.append(Step(f"{LONG_PROMPTS}: prefill piece of {engine.piece} tokens",
                              functools.partial(_pieces, engine, engine.piece + 1, engine.piece)))
        small = engine.interleave_piece
        if small < engine.piece and any(b > small for b in chosen):
            steps.append(Step(f"{LONG_PROMPTS}: prefill piece of {small} tokens (while others decode)",
                              functools.partial(_pieces, engine, small + 1, small)))
        chosen = [b for b in chosen if b <= engine.piece]
    for b in chosen:
        n = _shortest(b)
        steps.append(Step(f"prompt bucket {b}: prefill x 1 row", functools.partial(_prefill, engine, n, 1), b))
        rows = engine._group_rows(b)
        if rows > 1 and 2 * engine.allocator.pages_for(n + 1 + engine.extra) <= engine.allocator.num_pages:
            steps.append(Step(f"prompt bucket {b}: prefill x {rows} rows", functools.partial(_prefill, engine, n, 2),
                              b))
    unit = f"MTP rounds per call, K={engine.k}" if engine.k else "steps per call"
    steps.append(Step(f"decode loop ({engine.config.rounds_per_call} {unit})", functools.partial(_loop, engine)))
    for form, logprobs in (("sampling", False), ("logprobs", True)):
        steps.append(Step(f"decode loop with {form} ({engine.config.rounds_per_call} {unit})",
                          functools.partial(_sampled_loop, engine, logprobs)))
    if engine.adaptive:
        ks = ", ".join(map(str, adaptive_k.CANDIDATES))
        directory = engine.config.round_cost_dir
        stored = None if directory is None else round_costs.load(directory, engine)
        if stored is not None:
            steps.append(Step(f"round costs at K = {ks} from {round_costs.path(directory, engine)}",
                              functools.partial(setattr, engine, "round_cost", stored), recordable=False))
        else:
            steps.append(Step(f"timing a round at K = {ks}", functools.partial(_time_rounds, engine),
                              recordable=False))
    return steps


def compile_threads(engine) -> int:
    """Programs the warm-up compiles at once: --warmup_threads, or half the usable CPUs (XLA's compile of
    one program uses more than one core) up to MAX_COMPILE_THREADS; 1 under TP (its calls are not
    recorded)."""
    if engine.model.mesh is not None:
        return 1
    if engine.config.warmup_threads:
        return engine.config.warmup_threads
    # the CPUs this process may run on (containers narrow them); os.cpu_count() where that is not known
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_COMPILE_THREADS, cpus // 2))


def run(engine, steps: list[Step]) -> float:
    """Runs the warm-up steps (stopping early when the engine shuts down), logging each with its seconds
    and `engine.warming` its progress, after `precompile` where compile_threads > 1; then bounds the
    prefix cache's states by the device memory left and clears the counters the steps moved (refused
    requests stay counted). Returns the seconds."""
    t0, total = time.perf_counter(), len(steps)
    buckets = sorted({s.bucket for s in steps if s.bucket is not None})
    long = any(s.bucket is None and s.name.startswith(LONG_PROMPTS) for s in steps)
    engine.warming = (0, total)
    engine._log(f"warm-up: {total} programs to compile (prompt buckets {', '.join(map(str, buckets)) or 'none'}; "
                + (f"longer prompts in pieces of {engine.piece} tokens; " if long else "") + "the decode loop)")
    threads = compile_threads(engine)
    if threads > 1:
        compiled = precompile(engine, steps, threads)
        engine._log(f"warm-up: {compiled} programs compiled on {threads} threads in {time.perf_counter() - t0:.1f} s")
    for i, step in enumerate(steps, 1):
        if engine._stopping:
            engine._log(f"warm-up stopped after {i - 1} of {total} programs: shutting down")
            break
        t = time.perf_counter()
        step.run()
        engine.warming = (i, total)
        engine._log(f"warm-up [{i}/{total}] {step.name}: {time.perf_counter() - t:.2f} s")
    else:
        engine._log(f"warm-up done: {total} programs in {time.perf_counter() - t0:.1f} s")
        if engine.prefix is not None:
            _limit_prefix_states(engine)
    with engine._cv:
        refused = {k: v for k, v in engine.counters.items() if k.startswith("rejected_")}
        engine.counters.clear()
        engine.counters.update(refused)
        engine.warming = None
    return time.perf_counter() - t0


def _limit_prefix_states(engine) -> None:
    """Bounds the prefix cache's checkpoint states by the device memory the warm-up left (its programs ran:
    the peak so far is what serving needs besides them), keeping PREFIX_STATE_MARGIN of it free; under
    --prefix_cache_bytes=auto its budget becomes that bound plus the KV pool's bytes."""
    headroom = engine._device.memory_headroom()
    if headroom is None:
        return
    cache = engine.prefix
    cache.state_limit = max(int(headroom * (1 - PREFIX_STATE_MARGIN)), 0)
    if engine.config.prefix_cache_bytes == api.AUTO:
        cache.budget_bytes = engine.allocator.num_pages * cache.page_bytes + cache.state_limit
        engine._log(f"prefix cache: checkpoint states up to {cache.state_limit / 1e9:.2f} GB, the device memory the "
                    f"warm-up left ({headroom / 1e9:.2f} GB) less {PREFIX_STATE_MARGIN:.0%}, and KV pages up to the "
                    f"pool's {engine.allocator.num_pages} (--prefix_cache_bytes=auto)")
    elif cache.state_limit < cache.budget_bytes:
        engine._log(f"prefix cache: its checkpoint states take at most {cache.state_limit / 1e9:.2f} GB, the device "
                    f"memory the warm-up left ({headroom / 1e9:.2f} GB) less {PREFIX_STATE_MARGIN:.0%}; "
                    f"--prefix_cache_bytes={cache.budget_bytes} bounds them and its pages")


def precompile(engine, steps: list[Step], threads: int) -> int:
    """Compiles the programs the steps call, `threads` at a time: each recordable step runs with its device
    calls recorded (CompileRecorder), then the device state and carry are put back as they were. Returns the
    number of programs compiled."""
    device = engine._device
    state, slots = device.state, device.slots
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="qmtp-compile") as pool:
        recorder = CompileRecorder(pool.submit, device.device)
        device.call = recorder
        try:
            for step in steps:
                if engine._stopping:
                    break
                if step.recordable:
                    step.run()
        finally:
            device.call, device.state, device.slots = api._call, state, slots
        for future in recorder.compiles.values():
            future.result()  # a compile's error, here rather than in the serial pass
    return len(recorder.compiles)


def _prefix_steps(engine, chosen: list[int]) -> list[Step]:
    """With the prefix cache every prompt is prefilled in passes (qmtp/serve/prompt_passes.py) of padded widths
    up to prefill_chunk (under --deterministic, that one width): a program of one row per width and one of
    its batched rows where two prompts fit in the page pool and the rows pad to at most a piece (not under
    --deterministic), then a checkpoint and a resume from it."""
    deterministic = engine.model.kernels.deterministic
    widths = [engine.piece] if deterministic else [
        w for w in engine.prompt_buckets() if w <= min(engine.piece, max(chosen))]
    steps = []
    for w in widths:
        steps.append(Step(f"prefix cache: prefill pass of {w} tokens", functools.partial(_pass, engine, w, 1), w))
        rows, n = engine._group_rows(w), _shortest(w)
        if not deterministic and 1 < rows and rows * w <= engine.piece and \
                2 * engine.allocator.pages_for(n + 1 + engine.extra) <= engine.allocator.num_pages:
            steps.append(Step(f"prefix cache: prefill pass of {w} tokens x {rows} rows",
                              functools.partial(_pass, engine, w, 2), w))
    steps.append(Step("prefix cache: checkpoint and resume", functools.partial(_checkpoint_and_resume, engine)))
    return steps


def _shortest(bucket: int) -> int:
    """The fewest tokens a prompt (or pass) of this bucket has: the fewest pages."""
    return 1 if bucket == api.MIN_PROMPT_BUCKET else bucket // 2 + 1


def _pass(engine, width: int, count: int) -> None:
    """One pass of `width` padded tokens over `count` prompts of the fewest tokens that take it (distinct,
    so they share it; no checkpoint): one row, or the width's batched rows."""
    n = _shortest(width)
    for i in range(count):
        slot = engine.passes.start(*_request(engine, n, token=i))
        engine.passes.pending[slot].ends, engine.passes.pending[slot].keep = [n], ()
    engine.passes.run_one()
    engine._flush_retired()


def _checkpoint_and_resume(engine) -> None:
    """A prompt of two tokens kept at its end but the last token (as where another prompt awaits it: the
    programs of every kind of checkpoint), then the same prompt (resumed there); the cache is emptied after."""
    n = 2
    for i in range(2):
        handle = RequestHandle(engine, -1, [0] * n, 1, (), (), listener=lambda event: None)
        slot = engine.passes.start(handle, engine._free_slots.pop(), *engine.passes.reserve_with_prefix(handle))
        if i == 0:
            p = engine.passes.pending[slot]
            p.keep, p.ends = (n - 1,), [n - 1, n]
        while engine.passes.pending:
            engine.passes.run_one()
        engine._flush_retired()
    engine.prefix.clear()
    engine.prefix.reset_counts()


def _request(engine, n: int, token: int = 0) -> tuple:
    """A dummy request of n tokens (`token` repeated) with its slot and pages, as admission hands them out."""
    handle = RequestHandle(engine, -1, [token] * n, 1, (), (), listener=lambda event: None)
    return handle, engine._free_slots.pop(), engine.allocator.reserve(engine._capacity(handle))


def _prefill(engine, n: int, count: int) -> None:
    """count requests of n tokens prefilled together: 1 row, or the bucket's batched row count."""
    engine._prefill_group([_request(engine, n) for _ in range(count)])
    engine._flush_retired()


def _pieces(engine, n: int, piece: int) -> None:
    """A request of n > piece tokens prefilled in its two pieces (the one program of every piece of that
    size)."""
    slot = engine.passes.start(*_request(engine, n))
    while slot in engine.passes.pending:
        engine.passes.run_one(piece)
    engine._flush_retired()


def _sampled_loop(engine, logprobs: bool) -> None:
    """The loop's sampled form (with logprobs: the one that also returns them), with every slot done (it
    compiles and runs no round)."""
    engine._device.run(engine.config.rounds_per_call, engine._sampling.rows(range(engine.config.batch_slots),
                                                                           always=True), logprobs,
                       engine._round_costs())


def _time_rounds(engine, most_calls: int = 4) -> None:
    """engine.round_cost: every slot filled with a one-token dummy request (no stop ids, a budget for all
    the calls within max_model_len), then at each candidate K in turn (that K forced by the costs handed
    in) one untimed loop call and up to `most_calls` timed ones, of rounds_per_call rounds (the program
    serving runs); seconds over the rounds they ran. The dummies are released after."""
    ks = adaptive_k.CANDIDATES
    n, per_call = 1, engine.config.rounds_per_call
    calls = max(1, min(most_calls, (engine.max_model_len - n - 1) // (per_call * sum(k + 1 for k in ks)) - 1))
    budget = 1 + (calls + 1) * per_call * sum(k + 1 for k in ks)
    for slot in list(engine._free_slots)[::-1]:
        handle = RequestHandle(engine, -1, [0] * n, budget, (), (), listener=lambda event: None)
        capacity = engine._capacity(handle)
        if engine.allocator.pages_for(capacity) > engine.allocator.free_pages:
            break
        engine._prefill_group([(handle, engine._free_slots.pop(), engine.allocator.reserve(capacity))])
    costs = []
    for c in range(len(ks)):
        forced = adaptive_k.forcing(c)
        engine._device.run(per_call, None, False, forced)  # compiled by the loop step; this one warms the caches
        rounds, t0 = 0, time.perf_counter()
        for _ in range(calls):
            rounds += int(engine._device.run(per_call, None, False, forced)[3]["k_rounds"].sum())
        costs.append((time.perf_counter() - t0) / max(rounds, 1))
    for slot in list(engine._active):
        engine._release(slot, "abort")
    engine._flush_retired()
    engine.round_cost = np.asarray(costs, np.float32)
    if engine.config.round_cost_dir is not None:
        try:
            round_costs.save(engine.config.round_cost_dir, engine, engine.round_cost)
        except OSError as e:  # the costs still serve this process
            engine._log(f"round costs not kept in {engine.config.round_cost_dir}: {e}")


def _loop(engine) -> None:
    """One decode call with every slot done (it compiles and runs no round), and the retire op."""
    engine._run_loop()
    engine._device.retire(np.zeros(engine.config.batch_slots, bool))
