"""Named spans of host time: where the engine's and the runner's seconds go.

The engine and the runner open a span around each phase of a step (schedule,
prepare, dispatch, wait for tokens, process outputs) and of start-up (load,
KV cache, precompile). A span's seconds are its own: time spent in spans
opened inside it counts for those, not for it, so the totals add up to the
wall time covered and a program call or a wait for the device is never
counted as host work. Benchmarks read the totals; nothing in the product
changes its behaviour on them.
"""

from __future__ import annotations

import time
from collections import defaultdict


class Spans:
    """Exclusive seconds and entry counts per span name, accumulated over the engine's life."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.counts: defaultdict[str, int] = defaultdict(int)
        self._stack: list[_Span] = []

    def __call__(self, name: str) -> _Span:
        """A context manager that adds the seconds spent inside it, less its nested spans', to ``name``."""
        return _Span(self, name)

    def total(self, *names: str) -> float:
        """Seconds of the named spans together."""
        return sum(self.seconds.get(name, 0.0) for name in names)

    def reset(self) -> None:
        """Forget what was recorded (the spans open now keep counting from their start)."""
        self.seconds.clear()
        self.counts.clear()


class _Span:
    __slots__ = ("spans", "name", "start", "nested")

    def __init__(self, spans: Spans, name: str):
        self.spans = spans
        self.name = name

    def __enter__(self) -> _Span:
        self.nested = 0.0
        self.spans._stack.append(self)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        elapsed = time.perf_counter() - self.start
        spans = self.spans
        spans._stack.pop()
        spans.seconds[self.name] += elapsed - self.nested
        spans.counts[self.name] += 1
        if spans._stack:
            spans._stack[-1].nested += elapsed
