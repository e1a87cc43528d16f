"""What a command line is doing, on stderr: one line as each phase starts, a line every `every`
seconds while a phase runs long (a 27B speculative loop compiles for ~100 s), and the seconds each
phase took. stdout stays for results."""

from __future__ import annotations

import sys
import threading
import time


class Phases:
    """phases("loading x") starts a phase (ending the one before); phases.done() ends the last.

        generate: loading models/qmtp-demo
        generate:   done in 0.4 s
        generate: compiling prefill (bucket 16) and the MTP K=3 decode loop
        generate:   ... 10 s
        generate:   done in 12.9 s
    """

    def __init__(self, name: str, every: float = 10.0, stream=None):
        self.name, self.every, self.stream = name, every, stream or sys.stderr
        self._started: float | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __call__(self, what: str, tick: bool = True) -> None:
        """Starts a phase; tick=False: no lines while it runs (it shows its own progress)."""
        self.done()
        self._print(what)
        self._started = time.perf_counter()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, args=(self._stop, self._started), daemon=True)
        if tick:
            self._ticker.start()

    def done(self) -> None:
        if self._started is None:
            return
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        self._print(f"  done in {time.perf_counter() - self._started:.1f} s")
        self._started = None

    def _tick(self, stop: threading.Event, started: float) -> None:
        while not stop.wait(self.every):
            self._print(f"  ... {time.perf_counter() - started:.0f} s")

    def _print(self, line: str) -> None:
        print(f"{self.name}: {line}", file=self.stream, flush=True)
