"""Prometheus metrics (``prometheus-client``), served at ``/metrics``.

Counters and histograms are recorded as things happen; the sleep state, bytes per tag, queue
depth, the prefix cache's statistics and speculative decoding's counts are read from the engine
when Prometheus scrapes (``refresh``), so they are never a second copy of the engine's state.

Speculative decoding's counters are vLLM's (``vllm:spec_decode_*``) under dormant's prefix:
``dormant_spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos{position}`` (counters: scraped with ``_total``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from dormant.engine.outputs import RequestOutput

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """One registry per server (tests run several servers in one process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> Gauge:
            return Gauge(name, doc, ["model_name", *extra], registry=r)

        self.is_sleeping = gauge("dormant_is_sleeping", "1 while the engine sleeps or pauses")
        self.tag_bytes = gauge(
            "dormant_tag_bytes", "bytes per memory tag, where they are", ("tag", "location")
        )
        self.weight_version = gauge(
            "dormant_weight_version_info", "1 for the served weight version", ("version",)
        )
        self.requests_running = gauge("dormant_requests_running", "requests in the engine")
        self.prefix_cache = gauge(
            "dormant_prefix_cache", "the prefix cache: hit rate (of looked-up tokens), tokens "
            "looked up and hit, blocks cached and evictable, evictions, resets", ("quantity",),
        )  # fmt: skip
        self.requests_in_flight = gauge("dormant_http_requests_in_flight", "HTTP generations")
        self.durations = Histogram(
            "dormant_transition_seconds",
            "time of sleeps, wakes and refits",
            ["model_name", "kind"],
            buckets=_SECONDS,
            registry=r,
        )
        self.refit_bytes = Counter(
            "dormant_refit_bytes", "bytes written by refits", ["model_name"], registry=r
        )
        self.requests = Counter(
            "dormant_requests", "finished requests by reason", ["model_name", "reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "dormant_prompt_tokens", "prompt tokens of finished requests", ["model_name"],
            registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "dormant_generation_tokens", "generated tokens", ["model_name"], registry=r
        )
        self.wakes = Counter("dormant_auto_wakes", "wakes by --auto-wake", ["model_name"],
                             registry=r).labels(**labels)  # fmt: skip
        self._labels = labels
        self.spec_decode = _SpecDecodeCollector(model_name)
        r.register(self.spec_decode)

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Records how long the block took as a ``kind`` (sleep, wake, refit) transition."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.durations.labels(kind=kind, **self._labels).observe(time.perf_counter() - start)

    def add_refit_bytes(self, nbytes: int) -> None:
        self.refit_bytes.labels(**self._labels).inc(nbytes)

    @contextlib.contextmanager
    def track_request(self, serving: Any) -> Iterator[None]:
        gauge = self.requests_in_flight.labels(**self._labels)
        gauge.inc()
        serving.num_in_flight += 1
        try:
            yield
        finally:
            gauge.dec()
            serving.num_in_flight -= 1
            serving.last_activity = time.monotonic()

    def count_outputs(self, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            self.prompt_tokens.labels(**self._labels).inc(len(output.prompt_token_ids))
            for completion in output.outputs:
                reason = completion.finish_reason or "unfinished"
                self.requests.labels(reason=reason, **self._labels).inc()
                self.generation_tokens.labels(**self._labels).inc(len(completion.token_ids))

    def refresh(self, *, is_sleeping: bool, status: Any, num_requests: int, version: str) -> None:
        """The engine's state as of this scrape. ``status`` is rank 0's ``MemoryStatus``."""
        labels = self._labels
        self.is_sleeping.labels(**labels).set(1 if is_sleeping else 0)
        for tag in getattr(status, "tags", ()):
            for location, attribute in (("device", "mapped_bytes"), ("host", "host_bytes")):
                value = getattr(tag, attribute, None)
                if value is not None:
                    self.tag_bytes.labels(tag=tag.tag, location=location, **labels).set(value)
        self.requests_running.labels(**labels).set(num_requests)
        cache = getattr(status, "prefix_cache", None)  # the engine's, beside rank 0's memory
        if cache is not None and cache.is_enabled:
            for quantity, value in (
                ("hit_rate", cache.hit_rate), ("query_tokens", cache.num_query_tokens),
                ("hit_tokens", cache.num_hit_tokens), ("cached_blocks", cache.num_cached_blocks),
                ("evictable_blocks", cache.num_evictable_blocks),
                ("evictions", cache.num_evictions), ("resets", cache.num_resets),
            ):  # fmt: skip
                self.prefix_cache.labels(quantity=quantity, **labels).set(value)
        self.weight_version.clear()
        self.weight_version.labels(version=version, **labels).set(1)
        self.spec_decode.stats = getattr(status, "spec_decode", None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodeCollector(Collector):
    """Speculative decoding's counters, from the engine's totals of the last ``refresh``
    (nothing while speculation is off)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: Any = None  # SpecDecodeStats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.stats
        if stats is None:
            return
        name, labels = "dormant_spec_decode_", ["model_name"]
        for quantity, value in (
            ("num_drafts", stats.num_drafts),
            ("num_draft_tokens", stats.num_draft_tokens),
            ("num_accepted_tokens", stats.num_accepted_tokens),
        ):
            family = CounterMetricFamily(name + quantity, f"speculative {quantity}", labels=labels)
            family.add_metric([self.model_name], value)
            yield family
        per_pos = CounterMetricFamily(
            name + "num_accepted_tokens_per_pos",
            "drafts whose token at this position was accepted",
            labels=[*labels, "position"],
        )
        for position, value in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos
