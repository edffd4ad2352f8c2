"""Builds ``MemoryStatus`` from a manager's pools: per-tag bytes and the residual by owner."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from dormant.memory.allocation import State
from dormant.memory.policy import Policy
from dormant.memory.pool import TagPool
from dormant.memory.status import MemoryStatus, ResidualItem, TagStatus

if TYPE_CHECKING:
    from dormant.memory.manager import MemoryManager

UNOWNED = "not dormant's: CUDA context, NCCL, other libraries"


def build_status(
    manager: MemoryManager, pools: Mapping[str, TagPool], asleep: Mapping[str, Policy]
) -> MemoryStatus:
    tags = []
    for tag, pool in pools.items():
        allocations = pool.allocations
        tags.append(
            TagStatus(
                tag=tag,
                asleep_policy=asleep.get(tag),
                num_allocations=len(allocations),
                reserved_bytes=sum(a.size for a in allocations),
                mapped_bytes=sum(a.size for a in allocations if a.state is State.MAPPED),
                host_bytes=sum(a.region.nbytes for a in allocations if a.region is not None),
            )
        )
    backend = manager.backend
    free, total = backend.memory_info()
    used = total - free
    residual = [
        ResidualItem(f"dormant tag {t.tag!r} ({t.state})", t.mapped_bytes)
        for t in tags
        if t.mapped_bytes
    ]
    residual += [ResidualItem(owner, n) for owner, n in backend.other_usage().items() if n]
    unexplained = used - sum(r.nbytes for r in residual)
    if unexplained > 0:
        residual.append(ResidualItem(UNOWNED, unexplained))
    return MemoryStatus(
        backend=backend.name,
        device=str(backend.device),
        tags=tuple(tags),
        device_used_bytes=used,
        device_total_bytes=total,
        arena_capacity_bytes=manager.arena.capacity_bytes,
        arena_used_bytes=manager.arena.used_bytes,
        last_sleep=manager.last_sleep,
        last_wake=manager.last_wake,
        residual=tuple(residual),
    )
