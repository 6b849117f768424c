"""Counts XLA compilations in this process (for tests that a jitted step compiles once)."""

from __future__ import annotations

import jax


class CompileCounter:
    """``n``: backend compilations since the counter was made (JAX's monitoring event)."""

    def __init__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self)

    def __call__(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1


COMPILES = CompileCounter()  # one listener per process, shared by the test files
