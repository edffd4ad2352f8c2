"""vLLM's metrics reader (``vllm/v1/metrics/reader.py``): ``LLM.get_metrics()`` returns records
named ``vllm:*``, each a ``Counter``, ``Gauge``, ``Vector`` or ``Histogram`` with its labels.
NeMo-RL reads the speculative-decoding counters from them around every GRPO step
(``VllmGeneration.snapshot_step_metrics`` → the worker's ``_get_raw_spec_counters``:
``llm.get_metrics()`` where the engine has it, else ``get_metrics_snapshot()``).

dormant builds the records from the engine when asked (no second copy of its state):

    vLLM's name                                     type     from
    ──────────────────────────────────────────────  ───────  ─────────────────────────────────
    vllm:num_requests_running                       Gauge    the scheduler's running sequences
    vllm:num_requests_waiting                       Gauge    its waiting sequences
    vllm:kv_cache_usage_perc                        Gauge    1 - free (or evictable) KV blocks
                                                             / all of them, as vLLM's
    vllm:spec_decode_num_drafts                     Counter  ``engine.spec_decode_stats``,
    vllm:spec_decode_num_draft_tokens               Counter  only with speculative decoding
    vllm:spec_decode_num_accepted_tokens            Counter  (vLLM registers them only then)
    vllm:spec_decode_num_accepted_tokens_per_pos    Vector

Labels are vLLM's: ``model_name`` (the served name) and ``engine`` ("0"). vLLM's
``get_metrics_snapshot()`` reads the process's Prometheus registry; dormant registers nothing
process-wide (each server keeps its own registry), so it raises, naming the engine call to use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dormant.core.errors import UnsupportedOptionError


@dataclass
class Metric:
    """vLLM's base record: a metric's name and its labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    """Integer counters by position (only ``vllm:spec_decode_num_accepted_tokens_per_pos``)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """vLLM's shape; dormant reports no histograms through ``get_metrics``."""

    count: int
    sum: float
    buckets: dict[str, int]


def engine_metrics(engine: Any) -> list[Metric]:
    """The records of ``engine`` (an ``LLMEngine``) as it stands. On the engine's thread."""
    labels = {"model_name": str(engine.model_config.served_model_name), "engine": "0"}
    scheduler = engine.scheduler
    blocks = scheduler.block_manager
    usage = 1.0 - blocks.num_free_blocks / blocks.num_blocks
    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", dict(labels), float(scheduler.num_running)),
        Gauge("vllm:num_requests_waiting", dict(labels), float(scheduler.num_waiting)),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), usage),
    ]
    spec = engine.spec_decode_stats
    if spec is not None:
        metrics += [
            Counter("vllm:spec_decode_num_drafts", dict(labels), spec.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", dict(labels), spec.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), spec.num_accepted_tokens),
            Vector(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                dict(labels),
                list(spec.num_accepted_tokens_per_pos),
            ),
        ]
    return metrics


def get_metrics_snapshot() -> list[Metric]:
    """vLLM's process-wide snapshot, which dormant cannot take: raises what to do instead."""
    raise UnsupportedOptionError(
        "get_metrics_snapshot: dormant keeps no process-wide Prometheus registry; call "
        "get_metrics() on the engine (LLM or AsyncLLM), or scrape the server's /metrics. "
        "NeMo-RL: vllm_cfg.enable_vllm_metrics_logger=false"
    )
