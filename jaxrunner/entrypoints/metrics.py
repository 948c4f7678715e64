"""What the server measures, and its Prometheus exposition under vLLM's metric names.

The engine thread hands each stat logger, after every turn of its loop, the
scheduler's state (``SchedulerStats``) and what the turn's outputs brought
(``IterationStats``). ``PrometheusStatLogger`` keeps them in a registry of its
own that ``GET /metrics`` renders as Prometheus text; a dashboard made for
vLLM's ``vllm:`` metrics reads them unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import prometheus_client

from jaxrunner.engine.llm_engine import LLMEngine
from jaxrunner.engine.outputs import RequestOutput

# vLLM's buckets (seconds).
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]


@dataclasses.dataclass
class SchedulerStats:
    """The engines' state after a turn, summed over data-parallel replicas."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    """The fraction of KV cache blocks requests hold (blocks cached but unreferenced count as free)."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since the start."""
    prefix_cache_hits: int = 0
    """Of those, the tokens found cached."""

    @classmethod
    def of(cls, engines: Sequence[LLMEngine]) -> SchedulerStats:
        """The state of ``engines`` now (read on the engine thread)."""
        managers = [e.scheduler.kv_cache_manager for e in engines]
        usable = sum(m.num_usable_blocks for m in managers)
        free = sum(m.num_free_blocks for m in managers)
        return cls(
            num_running_reqs=sum(len(e.scheduler.running) for e in engines),
            num_waiting_reqs=sum(len(e.scheduler.waiting) for e in engines),
            kv_cache_usage=1.0 - free / usable if usable else 0.0,
            prefix_cache_queries=sum(m.stats.queries for m in managers),
            prefix_cache_hits=sum(m.stats.hits for m in managers),
        )


@dataclasses.dataclass
class IterationStats:
    """What one turn's outputs brought: tokens in and out, latencies, finished requests."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)

    def observe(self, output: RequestOutput, last_token_time: float | None, now: float) -> None:
        """Count a request's output delivered at ``now`` (``time.monotonic``); ``last_token_time``: when
        its previous tokens were, None before its first."""
        num_new = sum(len(c.token_ids) for c in output.outputs)
        if num_new:
            self.num_generation_tokens += num_new
            if last_token_time is None:
                self.num_prompt_tokens += len(output.prompt_token_ids)
                if output.metrics is not None:
                    self.time_to_first_tokens.append(now - output.metrics.arrival_time)
            else:
                self.inter_token_latencies.append(now - last_token_time)
        if output.finished:
            self.finish_reasons += [c.finish_reason or "abort" for c in output.outputs]


@runtime_checkable
class StatLogger(Protocol):
    """Takes the engine's statistics after every turn of its loop (on the engine thread)."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


class PrometheusStatLogger:
    """The statistics as Prometheus metrics with vLLM's names, labelled with the served model's name."""

    def __init__(self, model_name: str):
        self.registry = prometheus_client.CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, documentation: str) -> prometheus_client.Gauge:
            return prometheus_client.Gauge(name, documentation, labels, registry=self.registry)

        def counter(name: str, documentation: str) -> prometheus_client.Counter:
            return prometheus_client.Counter(name, documentation, labels, registry=self.registry)

        def histogram(name: str, documentation: str, buckets: list[float]) -> prometheus_client.Histogram:
            return prometheus_client.Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

        self._running = gauge("vllm:num_requests_running", "Requests in the running batch.").labels(model_name)
        self._waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.").labels(model_name)
        self._kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = every block held).").labels(model_name)
        self._prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(model_name)
        self._prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(
            model_name
        )
        self._prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests served.").labels(model_name)
        self._generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(model_name)
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Seconds from a request's arrival to its first token.", _TTFT_BUCKETS
        ).labels(model_name)
        self._itl = histogram(
            "vllm:inter_token_latency_seconds", "Seconds between a request's successive outputs.", _ITL_BUCKETS
        ).labels(model_name)
        self._success = prometheus_client.Counter(
            "vllm:request_success",
            "Sequences finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        self._prefix_seen = (0, 0)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """Update every metric with one turn's statistics."""
        self._running.set(scheduler_stats.num_running_reqs)
        self._waiting.set(scheduler_stats.num_waiting_reqs)
        self._kv_usage.set(scheduler_stats.kv_cache_usage)
        queries, hits = scheduler_stats.prefix_cache_queries, scheduler_stats.prefix_cache_hits
        seen_queries, seen_hits = self._prefix_seen
        if queries < seen_queries:  # the engine's counters were reset: all of them are new
            seen_queries = seen_hits = 0
        self._prefix_queries.inc(queries - seen_queries)
        self._prefix_hits.inc(max(hits - seen_hits, 0))
        self._prefix_seen = (queries, hits)
        self._prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self._generation_tokens.inc(iteration_stats.num_generation_tokens)
        for seconds in iteration_stats.time_to_first_tokens:
            self._ttft.observe(seconds)
        for seconds in iteration_stats.inter_token_latencies:
            self._itl.observe(seconds)
        for reason in iteration_stats.finish_reasons:
            self._success.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        """The metrics as Prometheus text."""
        return prometheus_client.generate_latest(self.registry)
