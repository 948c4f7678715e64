"""A device's timeline from a ``jax.profiler`` trace: busy time, idle gaps, and what borders each gap.

CUPTI's kernel record (``benchmarks.decode_step --profile``) says how long the kernels
ran, not what the device waited for between them. The profiler's trace holds
every kernel, copy and memset on every stream of the device, so the time with
nothing running can be split into its gaps: many short ones (the cost of one
kernel boundary) or a few long ones (a copy, a program boundary, the host), each
long gap named by the events on either side and by the host's longest events
during it (the trace's host threads: PjRt's calls, CUDA API calls such as a
synchronize, Python's). XLA runs programs without CUDA
graphs while it profiles unless ``--xla_enable_command_buffers_during_profiling``
is set; ``GRAPHS_WHILE_PROFILING_FLAG`` is that flag, for a trace of what runs untraced.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Sequence

GRAPHS_WHILE_PROFILING_FLAG = "--xla_enable_command_buffers_during_profiling=true"
GAP_BINS_US = (2.0, 10.0, 100.0)  # upper bounds of the gap classes; the last class is everything longer


@dataclasses.dataclass(frozen=True)
class Event:
    name: str
    line: str
    start_ns: float
    end_ns: float


def device_events(profile, plane_prefix: str = "/device:GPU:0", line_prefix: str = "Stream") -> list[Event]:
    """The events of the first plane named ``plane_prefix...``, on its lines named ``line_prefix...``
    (a GPU's streams; the derived lines a trace may also hold would count the same work twice).
    ``host_events`` reads the host's threads with the same function."""
    plane = next((p for p in profile.planes if p.name.startswith(plane_prefix)), None)
    if plane is None:
        return []
    return sorted(
        (
            Event(e.name, line.name, e.start_ns, e.start_ns + e.duration_ns)
            for line in plane.lines
            if line.name.startswith(line_prefix)
            for e in line.events
        ),
        key=lambda e: e.start_ns,
    )


def host_events(profile) -> list[Event]:
    """Every event on the host's threads (one line per thread)."""
    return device_events(profile, plane_prefix="/host:CPU", line_prefix="")


def save_events(path, device: list[Event], host: list[Event]) -> None:
    """The events as gzipped JSON: a trace's xplane file (tens of MB for a few decode steps) is too big to
    bring back from a lent machine, its events are not."""
    rows = lambda events: [[e.name, e.line, e.start_ns, e.end_ns] for e in events]
    with gzip.open(path, "wt") as f:
        json.dump({"device": rows(device), "host": rows(host)}, f)


def load_events(path) -> tuple[list[Event], list[Event]]:
    """The device's and the host's events that ``save_events`` wrote."""
    with gzip.open(path, "rt") as f:
        saved = json.load(f)
    return [Event(*row) for row in saved["device"]], [Event(*row) for row in saved["host"]]


def host_during(start_ns: float, end_ns: float, host: list[Event], top: int = 8) -> list[str]:
    """The ``top`` host events that overlap [start_ns, end_ns) the longest, innermost (shortest) first
    among equal overlaps, as "thread: name (overlap us; the event's whole duration and its start relative
    to the window's)": an event that began long before the window was waiting, one that began with it was
    working."""
    overlap = [
        (min(e.end_ns, end_ns) - max(e.start_ns, start_ns), e)
        for e in host
        if e.start_ns < end_ns and e.end_ns > start_ns
    ]
    overlap.sort(key=lambda x: (-round(x[0] / 1e3), x[1].end_ns - x[1].start_ns))
    return [
        f"{e.line}: {e.name[:60]} ({ns / 1e3:.0f} us; {(e.end_ns - e.start_ns) / 1e3:.0f} us from "
        f"{round((e.start_ns - start_ns) / 1e3):+d} us)"
        for ns, e in overlap[:top]
    ]


def kind_of(name: str) -> str:
    lowered = name.lower()
    return "copy" if "memcpy" in lowered else "memset" if "memset" in lowered else "kernel"


def summarize(events: list[Event], num_steps: int, top: int = 10, host: Sequence[Event] = ()) -> dict:
    """Per step: the span, the time some event runs (streams merged), the time per event kind, the idle
    gaps by length class, and the ``top`` longest gaps with the events that end and start them and,
    given the ``host``'s events, what the host was doing meanwhile."""
    if not events:
        return {"error": "no device events in the trace"}
    gaps = []
    busy_ns = 0.0
    run_start, run_end, last = events[0].start_ns, events[0].end_ns, events[0]
    for event in events[1:]:
        if event.start_ns > run_end:
            busy_ns += run_end - run_start
            gaps.append((event.start_ns - run_end, last.name, event.name, run_end))
            run_start = event.start_ns
        if event.end_ns >= run_end:
            run_end, last = event.end_ns, event
    busy_ns += run_end - run_start
    span_ns = run_end - events[0].start_ns
    per_kind: dict[str, list[float]] = {}
    for event in events:
        per_kind.setdefault(kind_of(event.name), []).append(event.end_ns - event.start_ns)
    bounds = [*GAP_BINS_US, float("inf")]
    classes = {}
    for low, high in zip([0.0, *GAP_BINS_US], bounds):
        inside = [g for g, *_ in gaps if low * 1e3 <= g < high * 1e3]
        classes[f"{low:g}-{high:g} us"] = {
            "per_step": len(inside) / num_steps,
            "ms_per_step": sum(inside) / 1e6 / num_steps,
        }
    return {
        "span_ms_per_step": span_ns / 1e6 / num_steps,
        "busy_ms_per_step": busy_ns / 1e6 / num_steps,
        "idle_ms_per_step": (span_ns - busy_ns) / 1e6 / num_steps,
        "kinds": {
            k: {"per_step": len(d) / num_steps, "ms_per_step": sum(d) / 1e6 / num_steps} for k, d in per_kind.items()
        },
        "gaps": classes,
        "longest_gaps": [
            {"us": g / 1e3, "after": a[:80], "before": b[:80], "host": host_during(start, start + g, list(host))}
            for g, a, b, start in sorted(gaps, reverse=True)[:top]
        ],
    }


def print_summary(label: str, summary: dict) -> None:
    if "error" in summary:
        print(f"{label}: {summary['error']}")
        return
    kinds = ", ".join(f"{k} {v['per_step']:.0f} x {v['ms_per_step']:.2f} ms" for k, v in summary["kinds"].items())
    print(
        f"{label}: span {summary['span_ms_per_step']:.2f} ms a step, busy {summary['busy_ms_per_step']:.2f}, "
        f"idle {summary['idle_ms_per_step']:.2f}; {kinds}"
    )
    print(
        "  idle gaps a step: "
        + ", ".join(f"{name} {c['per_step']:.0f} = {c['ms_per_step']:.2f} ms" for name, c in summary["gaps"].items())
    )
    for gap in summary["longest_gaps"]:
        print(f"  {gap['us']:8.1f} us after {gap['after']!r} before {gap['before']!r}")
        for event in gap["host"]:
            print(f"             host {event}")
