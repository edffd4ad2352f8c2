"""SGLang's ``GET /v1/loads`` (``sglang/srt/entrypoints/v1_loads.py`` over its scheduler's
``LoadSnapshot``): the engine's load. slime polls it after aborting a rollout
(``server_control.abort_server_until_idle`` sums ``num_running_reqs`` and ``num_waiting_reqs``
until both are 0); SGLang's router reads the same keys to balance.

    {"timestamp": ISO 8601 (UTC), "version": ..., "loads": [{
        "dp_rank": 0, "num_running_reqs", "num_waiting_reqs", "num_used_tokens",
        "max_total_num_tokens", "max_running_requests", "token_usage", "cache_hit_rate",
        "memory": {...}, "speculative": {...}, "disaggregation": {...}}]}

What each number is here (read on the engine's loop, between two steps):

| key                   | dormant's                                                         |
|-----------------------|-------------------------------------------------------------------|
| num_running_reqs      | sequences in the scheduler's running queue (SGLang counts each of |
|                       | a request's ``n`` samples, as these are)                          |
| num_waiting_reqs      | sequences waiting, samples waiting to fork from their first too  |
| num_used_tokens       | KV slots of the blocks sequences hold (a block's unused tail too) |
| max_total_num_tokens  | KV slots of all blocks (``num_blocks * block_size``)              |
| token_usage           | the two above's ratio (held blocks over all blocks)               |
| max_running_requests  | ``max_num_seqs``                                                  |
| cache_hit_rate        | the prefix cache's, over its life (SGLang's is a recent window)   |

Sections, as SGLang's ``include`` picks them (comma separated: ``core``, ``memory``, ``spec``,
``lora``, ``disagg``, ``queues``, ``all``; default all): ``memory`` (rank 0's weights, KV cache
and CUDA graph bytes, and the KV slots), ``speculative`` (once speculative decoding verified a
draft), ``disaggregation`` (mode "null": dormant serves prefill and decode together). SGLang's
``num_waiting_uncached_tokens``, ``num_total_tokens``, ``gen_throughput`` and ``utilization``
are not sent, nor the ``lora`` and ``queues`` sections: dormant does not measure them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from dormant.engine.async_llm import AsyncLLM
from dormant.engine.llm_engine import LLMEngine
from dormant.server.errors import BadRequestError

router = APIRouter()
SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
GiB = 2**30


@router.get("/v1/loads")
async def get_loads(
    request: Request,
    include: Annotated[str | None, Query()] = None,
    dp_rank: Annotated[int | None, Query()] = None,
    output_format: Annotated[str | None, Query(alias="format")] = None,
) -> dict[str, Any]:
    sections = _sections(include)
    if output_format not in (None, "json"):
        raise BadRequestError(
            f"format={output_format!r}: /v1/loads answers JSON only (format=json); scrape "
            "/metrics for Prometheus"
        )
    app = request.app
    engine: AsyncLLM = app.state.serving.engine
    loads = []
    if dp_rank in (None, 0):  # one data-parallel rank; SGLang answers none for another
        load, spec = await engine.call(lambda: _snapshot(engine.engine))
        if _wants("memory", sections):
            status = (await engine.memory_status())[0]  # rank 0's, as SGLang's scheduler
            load["memory"] = _memory(status, load["max_total_num_tokens"])
        if _wants("spec", sections) and spec is not None:
            load["speculative"] = spec
        if _wants("disagg", sections):
            load["disaggregation"] = dict(_NO_DISAGGREGATION)
        loads.append(load)
    return {"timestamp": datetime.now(UTC).isoformat(), "version": app.version, "loads": loads}


def _sections(include: str | None) -> frozenset[str]:
    if include is None:
        return frozenset({"all"})
    names = frozenset(name.strip() for name in include.split(","))
    if not names <= SECTIONS:
        raise BadRequestError(
            f"include names unknown sections {sorted(names - SECTIONS)}; give a comma-separated "
            f"list of {sorted(SECTIONS)}, or leave it out for all"
        )
    return names


def _wants(section: str, sections: frozenset[str]) -> bool:
    return "all" in sections or section in sections


def _snapshot(engine: LLMEngine) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The core keys, from the scheduler and its block manager (on the loop: one consistent
    view between two steps), and the ``speculative`` section (None before any draft)."""
    scheduler, blocks = engine.scheduler, engine.scheduler.block_manager
    num_used, num_total = blocks.num_used_blocks, blocks.num_blocks
    load = {
        "dp_rank": 0,
        "num_running_reqs": scheduler.num_running,
        "num_waiting_reqs": scheduler.num_waiting,
        "num_used_tokens": num_used * blocks.block_size,
        "max_total_num_tokens": num_total * blocks.block_size,
        "max_running_requests": engine.config.max_num_seqs,
        "token_usage": round(num_used / num_total, 4),
        "cache_hit_rate": round(blocks.prefix_cache_stats().hit_rate, 4),
    }
    stats = engine.spec_decode_stats
    if stats is None or not stats.num_drafts:
        return load, None
    return load, {
        "accept_length": stats.mean_acceptance_length,
        "accept_rate": stats.acceptance_rate,
    }


def _memory(status: Any, num_kv_slots: int) -> dict[str, Any]:
    """SGLang's ``MemoryMetrics``: each tag's size (mapped or asleep), and the KV slots."""

    def gib(tag: str) -> float:
        sizes = [t.reserved_bytes for t in status.tags if t.tag == tag]
        return round(sum(sizes) / GiB, 3)

    return {
        "weight_gb": gib("weights"),
        "kv_cache_gb": gib("kv_cache"),
        "graph_gb": gib("cuda_graph"),
        "token_capacity": num_kv_slots,
    }


_NO_DISAGGREGATION = {
    "mode": "null",
    "prefill_bootstrap_queue_reqs": 0,
    "prefill_inflight_queue_reqs": 0,
    "decode_prealloc_queue_reqs": 0,
    "decode_transfer_queue_reqs": 0,
    "decode_retracted_queue_reqs": 0,
    "kv_transfer_speed_gb_s": 0.0,
    "kv_transfer_latency_ms": 0.0,
}
