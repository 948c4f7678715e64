"""Static-shape bucketing: the ladders, padding to a bucket, and counting compiles.

Bucketing plays the role CUDA graphs play in vLLM: every step runs one of a
fixed set of programs, compiled ahead of time. A compile after warm-up is a
bug, so compiles are counted.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import jax
from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def default_ladder(max_size: int) -> list[int]:
    """Bucket sizes up to ``max_size``: dense where decode batches live, sparse above.

    1, 2, 4, 8, then steps of 8 to 64, 16 to 256, then two sizes per octave
    (256, 384, 512, 768, ...). ``max_size`` itself is always the last bucket.
    """
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, 65, 8)) + list(range(80, 257, 16))
    octave = 256
    while octave < max_size:
        sizes += [octave + octave // 2, octave * 2]
        octave *= 2
    return sorted({s for s in sizes if s < max_size} | {max_size})


def make_ladder(requested: Iterable[int] | None, max_size: int, name: str) -> list[int]:
    """The configured ladder, checked, or the default one; it always reaches ``max_size``."""
    if requested is None:
        return default_ladder(max_size)
    ladder = sorted(set(int(b) for b in requested))
    if ladder[-1] < max_size:
        raise ValueError(
            f"CompilationConfig.{name} must reach {max_size} (the scheduler's limit); "
            f"its largest bucket is {ladder[-1]}. Add {max_size} to the ladder."
        )
    return ladder


def pad_to_bucket(size: int, ladder: list[int], what: str) -> int:
    """The smallest bucket that holds ``size``; a clear error past the largest."""
    i = bisect.bisect_left(ladder, size)
    if i == len(ladder):
        raise ValueError(
            f"A batch of {size} {what} exceeds the largest bucket ({ladder[-1]}). "
            f"Raise the scheduler limit and the bucket ladder, or schedule fewer {what} per step."
        )
    return ladder[i]


class CompileCounter:
    """Counts every XLA program JAX builds in this process (compiled or read from cache).

    JAX reports each backend compilation through ``jax.monitoring``; counting
    that event catches compiles our own code does not know it triggers, such
    as an eager op on a new shape.
    """

    _lock = threading.Lock()
    _count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        """Start counting backend compiles (once per process; later calls do nothing)."""
        with cls._lock:
            if cls._installed:
                return
            monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._installed = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs: Any) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with cls._lock:
                cls._count += 1

    @classmethod
    def count(cls) -> int:
        """Backend compiles since ``install``."""
        cls.install()
        return cls._count


class CompiledPrograms:
    """Ahead-of-time compiled programs of one jitted function, one per bucket.

    ``get(bucket)`` returns the program for a bucket, compiling it on first
    use; ``num_compiled`` counts the buckets compiled so far.
    """

    def __init__(
        self, name: str, lower: Callable[[Hashable], jax.stages.Lowered],
        compiler_options: Callable[[Hashable], dict[str, str | bool | int]] = lambda bucket: {},
    ):
        self.name = name
        self._lower = lower
        self._compiler_options = compiler_options
        self._programs: dict[Hashable, jax.stages.Compiled] = {}

    def get(self, bucket: Hashable) -> jax.stages.Compiled:
        """The program for ``bucket``, lowered and compiled (with the bucket's ``compiler_options``) on first use."""
        program = self._programs.get(bucket)
        if program is None:
            program = self._lower(bucket).compile(compiler_options=self._compiler_options(bucket))
            self._programs[bucket] = program
        return program

    @property
    def num_compiled(self) -> int:
        """How many buckets have a compiled program."""
        return len(self._programs)

    def memory_bytes(self) -> dict[str, dict[str, int]]:
        """XLA's memory analysis of each compiled program, by bucket: argument, output, aliased
        (donated inputs reused as outputs) and temporary bytes. A program whose temporaries hold a
        copy of its donated inputs shows it here before it runs out of memory."""
        sizes = {}
        for bucket, program in self._programs.items():
            analysis = program.memory_analysis()
            if analysis is not None:
                sizes[str(bucket)] = {
                    field: int(getattr(analysis, f"{field}_size_in_bytes"))
                    for field in ("argument", "output", "alias", "temp", "generated_code")
                }
        return sizes
