"""Builds ``MemoryStatus`` from a manager's parts: per-tag states and bytes, derived from the
allocations, and the residual by owner."""

from __future__ import annotations

from dormant.memory import nvml
from dormant.memory.blocks import BlockTable
from dormant.memory.context_release import ContextRelease
from dormant.memory.residual import ResidualLedger
from dormant.memory.states import State
from dormant.memory.status import (
    ContextReport,
    MemoryStatus,
    ResidualItem,
    SleepReport,
    TagStatus,
    WakeReport,
)
from dormant.memory.tag_machine import count_states, tag_state

UNOWNED = "not dormant's: CUDA context, NCCL, other libraries"
CHECKPOINTED = "this process, its CUDA state checkpointed by the driver (NVML)"
UNFREED = "dormant: dead blocks whose free failed (retried at the next call)"


def status_of(
    table: BlockTable,
    last_sleep: SleepReport | None,
    last_wake: WakeReport | None,
    ledger: ResidualLedger,
    context: ContextRelease,
) -> MemoryStatus:
    """The status: in full, or while the CUDA context is released from NVML alone, read by
    the checkpoint helper (this process's own CUDA and NVML calls would block)."""
    report = context.last
    if report is not None and report.is_released:
        return released_status(table, last_sleep, last_wake, context.outside_reading(), report)
    return build_status(table, last_sleep, last_wake, ledger, report)


def build_status(
    table: BlockTable,
    last_sleep: SleepReport | None,
    last_wake: WakeReport | None,
    ledger: ResidualLedger | None = None,
    context: ContextReport | None = None,
) -> MemoryStatus:
    """The status of ``table``'s tags, its backend and its arena, with the last reports. With a
    CUDA ``ledger`` the residual is measured by owner (residual.py); otherwise what is not the
    tags' or the backend's known owners' is one row."""
    backend = table.backend
    tags = tag_statuses(table)
    residual = _tag_rows(table, tags)
    released: tuple[ResidualItem, ...] = ()
    if ledger is not None and ledger.is_cuda:
        now, rows = ledger.items()
        used, total = now.device_used_bytes, now.device_total_bytes
        residual += rows
        released = tuple(ledger.released_items())
    else:
        free, total = backend.memory_info()
        used = total - free
        residual += [ResidualItem(owner, n) for owner, n in backend.other_usage().items() if n]
        unexplained = used - sum(r.nbytes for r in residual)
        if unexplained > 0:
            residual.append(ResidualItem(UNOWNED, unexplained))
    return _status(table, tags, used, total, last_sleep, last_wake, residual, released, context)


def released_status(
    table: BlockTable,
    last_sleep: SleepReport | None,
    last_wake: WakeReport | None,
    reading: nvml.Reading,
    context: ContextReport,
) -> MemoryStatus:
    """The status while the process's CUDA state is checkpointed: no CUDA or NVML call of this
    process (both block until the restore), so the device figures are NVML's as ``reading``
    (``ContextRelease.outside_reading``) has them; without NVML they are unknown (zero, with a
    row saying so)."""
    tags = tag_statuses(table)
    residual = _tag_rows(table, tags)
    process, memory = reading
    used, total = (0, 0) if memory is None else memory
    if process is None:
        residual.append(ResidualItem(CHECKPOINTED + ": unknown, no NVML reading", 0))
    else:
        residual.append(ResidualItem(CHECKPOINTED, process))
        if memory is not None:
            residual.append(ResidualItem("other processes on this device (NVML)", used - process))
    return _status(table, tags, used, total, last_sleep, last_wake, residual, (), context)


def tag_statuses(table: BlockTable) -> list[TagStatus]:
    statuses = []
    for tag, pool in table.pools.items():
        allocations = pool.allocations
        statuses.append(
            TagStatus(
                tag=tag,
                state=tag_state(allocations),
                num_by_state=count_states(allocations),
                reserved_bytes=sum(a.size for a in allocations),
                mapped_bytes=sum(a.size for a in allocations if a.state is State.MAPPED),
                held_bytes=sum(a.size for a in allocations if a.handle is not None),
                host_bytes=sum(a.region.nbytes for a in allocations if a.region is not None),
                block_bytes=pool.used_bytes,
            )
        )
    return statuses


def _tag_rows(table: BlockTable, tags: list[TagStatus]) -> list[ResidualItem]:
    """The tags' rows, and the row of the memory whose free failed (``BlockTable.dying``)."""
    rows = [
        ResidualItem(f"dormant tag {t.tag!r} ({t.describe()})", t.held_bytes)
        for t in tags
        if t.held_bytes
    ]
    if table.unfreed_bytes:
        rows.append(ResidualItem(UNFREED, table.unfreed_bytes))
    return rows


def _status(
    table: BlockTable,
    tags: list[TagStatus],
    used: int,
    total: int,
    last_sleep: SleepReport | None,
    last_wake: WakeReport | None,
    residual: list[ResidualItem],
    released: tuple[ResidualItem, ...],
    context: ContextReport | None,
) -> MemoryStatus:
    return MemoryStatus(
        backend=table.backend.name,
        device=str(table.backend.device),
        tags=tuple(tags),
        device_used_bytes=used,
        device_total_bytes=total,
        arena_capacity_bytes=table.arena.capacity_bytes,
        arena_used_bytes=table.arena.used_bytes,
        last_sleep=last_sleep,
        last_wake=last_wake,
        residual=tuple(residual),
        released=released,
        context=context,
        unfreed_bytes=table.unfreed_bytes,
    )
