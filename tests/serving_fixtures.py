"""Shapes and helpers shared by tests/test_engine.py and tests/test_server.py (their fixtures, the tiny
checkpoint `ckpt` and its `model`, and `single_threaded_cpu_blas`, live in tests/conftest.py).

Every engine of both files has these shapes (3 slots, page size 8, max_model_len 48, 12 pages, 2 rounds
per call), so the prefill (prompt buckets 16 and 32) and the loop compile once per K for both files
(the warm-up tests add bucket 64, the largest these limits admit, at K=0).
"""

from __future__ import annotations

from qmtp.serve.engine import Engine
from qmtp.serve.engine_config import EngineConfig

SLOTS, PAGE, MAX_LEN, PAGES, ROUNDS = 3, 8, 48, 12, 2


def make_engine(model, k, start=True, log=None, **kw) -> Engine:
    """An engine of the shared shapes with mtp_k=k, without the prefix cache (its own tests turn it on);
    **kw overrides or adds EngineConfig fields; log: the engine's log-line callback (None: its default,
    stdout)."""
    cfg = dict(batch_slots=SLOTS, mtp_k=k, rounds_per_call=ROUNDS, max_model_len=MAX_LEN, num_pages=PAGES,
               prefix_cache_bytes=0)
    cfg.update(kw)
    engine = Engine(model, EngineConfig(**cfg), log=log)
    return engine.start() if start else engine


def assert_all_free(engine: Engine, internals: bool = True) -> None:
    """Every page and slot is back (a page the prefix cache holds counts as back), and each admitted
    request released exactly once. With internals (the engine tests), also the allocator's page count
    and the scheduler's own slot bookkeeping; the server tests (internals=False) check what stats()
    reports only."""
    s = engine.stats()
    cached = 0 if engine.prefix is None else len(engine.prefix._page_holds)
    assert s["free_pages"] + cached == s["num_pages"], s
    assert s["free_slots"] == SLOTS and s["active"] == 0 and s["queued"] == 0, s
    assert engine.counters["released"] == engine.counters["admitted"], dict(engine.counters)
    if internals:
        assert s["num_pages"] == engine.allocator.num_pages, s
        assert not engine._active and sorted(engine._free_slots) == list(range(SLOTS))


def logged_device_calls(engine: Engine) -> list[str]:
    """Records each device call of the engine ("piece", "prefill", "run") in order (the engine instance's
    methods wrapped; nothing global)."""
    calls, device = [], engine._device
    for name, label in (("prefill_piece", "piece"), ("prefill", "prefill"), ("run", "run")):
        def wrapped(*a, _f=getattr(device, name), _label=label, **kw):
            calls.append(_label)
            return _f(*a, **kw)
        setattr(device, name, wrapped)
    return calls
