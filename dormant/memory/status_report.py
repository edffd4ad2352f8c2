"""Builds ``MemoryStatus`` from a manager's parts: per-tag states and bytes, derived from the
allocations, and the residual by owner."""

from __future__ import annotations

from dormant.memory.blocks import BlockTable
from dormant.memory.states import State
from dormant.memory.status import MemoryStatus, ResidualItem, SleepReport, TagStatus, WakeReport
from dormant.memory.tag_machine import count_states, tag_state

UNOWNED = "not dormant's: CUDA context, NCCL, other libraries"


def build_status(
    table: BlockTable, last_sleep: SleepReport | None, last_wake: WakeReport | None
) -> MemoryStatus:
    """The status of ``table``'s tags, its backend and its arena, with the last reports."""
    backend, arena = table.backend, table.arena
    tags = []
    for tag, pool in table.pools.items():
        allocations = pool.allocations
        tags.append(
            TagStatus(
                tag=tag,
                state=tag_state(allocations),
                num_by_state=count_states(allocations),
                reserved_bytes=sum(a.size for a in allocations),
                mapped_bytes=sum(a.size for a in allocations if a.state is State.MAPPED),
                held_bytes=sum(a.size for a in allocations if a.handle is not None),
                host_bytes=sum(a.region.nbytes for a in allocations if a.region is not None),
            )
        )
    free, total = backend.memory_info()
    used = total - free
    residual = [
        ResidualItem(f"dormant tag {t.tag!r} ({t.describe()})", t.held_bytes)
        for t in tags
        if t.held_bytes
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
        arena_capacity_bytes=arena.capacity_bytes,
        arena_used_bytes=arena.used_bytes,
        last_sleep=last_sleep,
        last_wake=last_wake,
        residual=tuple(residual),
    )
