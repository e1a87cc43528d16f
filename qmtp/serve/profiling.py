"""A device profile of a running server, on request: POST /start_profile begins a JAX profiler trace
into the server's --profile_dir, POST /stop_profile ends and writes it (one trace at a time): an xplane
for TensorBoard's profile plugin and a perfetto_trace.json.gz for Perfetto and `scripts/trace_summary.py`.
The trace covers every device call of the process in between, so a load run between the two posts
(`scripts/load_test.py --profile`) shows where a served step's time goes.
"""

from __future__ import annotations

import os
import threading

import jax


class ProfileError(Exception):
    """A start or stop that does not apply now (a message for the client)."""


class Profiler:
    """Starts and stops one JAX trace at a time into `directory` ("" = profiling off)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._lock = threading.Lock()
        self._active = False

    def start(self) -> str:
        """Begins a trace; returns the directory it writes to."""
        with self._lock:
            self._check_on()
            if self._active:
                raise ProfileError("a profile is already running: POST /stop_profile first")
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self._active = True
            return self.directory

    def stop(self) -> str:
        """Ends the trace and writes it; returns the directory it went to."""
        with self._lock:
            self._check_on()
            if not self._active:
                raise ProfileError("no profile is running: POST /start_profile first")
            jax.profiler.stop_trace()
            self._active = False
            return self.directory

    def _check_on(self) -> None:
        if not self.directory:
            raise ProfileError("profiling is off: start the server with --profile_dir=DIR")
