"""The byte-moving half of sleep, over a chosen set of allocations (wake: ``transitions.py``).

The tag machine (``tag_machine.py``) decides *which* allocations sleep; this makes the change in
the order DESIGN §2.3 requires, overlapping driver work with the copies, records every step as
soon as it lands (``steps.py``), and reports timings.

    synchronize the device           never copy or unmap under running kernels
    place host copies in the arena   (may grow it, or wait for its background preparation: an
                                     error here changes nothing)
    hash MAPPED HOST allocations     in groups of about 1/8 of the bytes, largest first, all
                                     launched at once; waited for in order. Unchanged since their
                                     last offload → no copy. Until the first changed one is found,
                                     each group's unchanged allocations are released as soon as
                                     its digests land, while the later groups still hash
    start the D2H copies             one per stale allocation, largest first, asynchronous; each
                                     one's host copy is marked invalid before its copy starts
    release DISCARD                  while the copies run (``DiscardOrder``)
    release the other unchanged      while the copies run, largest first
    release each stale allocation    as soon as its own copy has landed (host copy now valid)

Why no copy starts before every digest is known: a group's digests come back by a small
device-to-host copy, which queues behind the device-to-host copies already running. On the H200
(2026-12-01b run 2), a sleep that started each group's copies as soon as that group's digests
landed waited 140 ms of its 175 ms for digests, and released the KV cache only after that wait,
so the KV release no longer ran under the copies (1.13 x the copy limit). Releasing unchanged
allocations under the later groups' hashing queues no copy, so it delays no digest.

``DiscardOrder`` says when the DISCARD releases (the KV cache: ~11-22 ms for 32 GiB on the H200)
run against the copies. UNDER_COPIES, the default, is the order measured at 1.03 x the copy limit
(2026-11-29 run 5, 2026-12-01 run 4); the others exist so that ``benchmarks/sleep_wake.py
--discard-orders`` can measure which one hides the release on a given driver.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Sequence

from dormant.memory.allocation import Allocation, State
from dormant.memory.arena import HostArena
from dormant.memory.backend import Backend, Copy
from dormant.memory.errors import UnknownDiscardOrderError
from dormant.memory.policy import Policy, member_named
from dormant.memory.release_history import ReleaseHistory
from dormant.memory.status import SleepReport
from dormant.memory.steps import ReleaseClock, drain, region_of

HASH_GROUPS = 8  # a sleep hashes its HOST allocations in about this many groups,
HASH_GROUP_MIN_BYTES = 64 << 20  # each of at least this many bytes (read at each sleep)


class DiscardOrder(enum.Enum):
    """When a sleep releases its DISCARD allocations, relative to the HOST copies."""

    UNDER_COPIES = "under copies"  # every copy started, then the releases, then the waits
    BEFORE_COPIES = "before copies"  # released, then the copies started
    UNMAP_FIRST = "unmap first"  # unmapped before the copies start, released under them
    THREAD = "thread"  # a helper thread releases them while this one starts the copies
    AFTER_COPIES = "after copies"  # once every copy has landed

    @classmethod
    def parse(cls, value: DiscardOrder | str) -> DiscardOrder:
        """Accepts a DiscardOrder or its value; raises UnknownDiscardOrderError otherwise."""
        member = member_named(cls, value)
        if member is not None:
            return member
        names = ", ".join(repr(o.value) for o in cls)
        raise UnknownDiscardOrderError(f"unknown discard order {value!r}; use one of {names}")


def sleep_allocations(
    backend: Backend,
    arena: HostArena,
    host: Sequence[Allocation],
    discard: Sequence[Allocation],
    *,
    skip_unchanged: bool,
    discard_order: DiscardOrder = DiscardOrder.UNDER_COPIES,
    releases: ReleaseHistory | None = None,
) -> SleepReport:
    """Offloads ``host`` and discards ``discard``; each release is noted in ``releases``.

    Preconditions: each allocation is MAPPED, or UNMAPPED on its way into the same policy (a HOST
    one then has a valid host copy). A MAPPED HOST allocation whose content hash equals the digest
    of its valid arena copy is not copied again. An error placing arena regions or hashing changes
    nothing; a failed release or copy leaves each allocation as its last landed step recorded.
    """
    t0 = time.perf_counter()
    backend.synchronize()
    t_sync = time.perf_counter()

    homeless = [a for a in host if a.region is None]
    if homeless:
        regions = arena.allocate([a.size for a in homeless])
        for allocation, region in zip(homeless, regions, strict=True):
            allocation.region, allocation.has_host_copy, allocation.digest = region, False, None
    t_arena = time.perf_counter()

    clock = ReleaseClock(backend, releases)
    groups = hash_groups([a for a in host if a.state is State.MAPPED])
    stale, unchanged = _sort_by_digest(backend, groups, skip_unchanged, clock)
    t_hash, released_while_hashing = time.perf_counter(), clock.release_s

    discards = sorted(discard, key=lambda a: -a.size)
    batch = backend.copy_batch()
    helper: _DiscardThread | None = None
    try:
        if discard_order is DiscardOrder.BEFORE_COPIES:
            for allocation in discards:
                clock.release(allocation, Policy.DISCARD)
        elif discard_order is DiscardOrder.UNMAP_FIRST:
            for allocation in discards:
                clock.unmap(allocation, Policy.DISCARD)
        elif discard_order is DiscardOrder.THREAD:
            helper = _DiscardThread(clock, discards)
        for allocation, _ in stale:
            allocation.has_host_copy, allocation.digest = False, None  # being overwritten
            batch.add(Copy(region_of(allocation).address, allocation.va, allocation.size))
        if discard_order in (DiscardOrder.UNDER_COPIES, DiscardOrder.UNMAP_FIRST):
            for allocation in discards:
                clock.release(allocation, Policy.DISCARD)
        for allocation in unchanged:  # their arena copies are valid
            clock.release(allocation, Policy.HOST)
        for allocation in host:
            if allocation.state is State.UNMAPPED:  # a failed sleep's: its copy is valid
                clock.release(allocation, Policy.HOST)
        for index, (allocation, digest) in enumerate(stale):
            batch.wait(index)
            allocation.has_host_copy, allocation.digest = True, digest
            allocation.is_dirty = False
            clock.release(allocation, Policy.HOST)
        if stale:
            batch.wait_all()
        if discard_order is DiscardOrder.AFTER_COPIES:
            for allocation in discards:
                clock.release(allocation, Policy.DISCARD)
        if helper is not None:
            helper.join()
    except BaseException as error:
        drain(batch, error)
        if helper is not None:
            helper.join_after(error)
        raise
    t_end = time.perf_counter()

    copied = sum(a.size for a, _ in stale)
    hashed = sum(a.size for group in groups for a in group)
    return SleepReport(
        total_s=t_end - t0,
        sync_s=t_sync - t0,
        arena_s=t_arena - t_sync,
        hash_s=t_hash - t_arena - released_while_hashing,
        copy_s=t_end - t_hash,  # copies, with the releases overlapped under them
        release_s=clock.release_s,
        discard_s=clock.discard_s,
        bytes_copied=copied,
        bytes_skipped=hashed - copied,
        bytes_released=sum(a.size for a in (*host, *discard)),
    )


def hash_groups(allocations: Sequence[Allocation]) -> list[list[Allocation]]:
    """``allocations``, largest first, cut into about ``HASH_GROUPS`` groups of similar bytes
    (at least ``HASH_GROUP_MIN_BYTES`` each): launched one after another, so that the device
    hashes the later groups while the host works on the first one's digests."""
    ordered = sorted(allocations, key=lambda a: -a.size)
    target = max(sum(a.size for a in ordered) // HASH_GROUPS, HASH_GROUP_MIN_BYTES)
    groups: list[list[Allocation]] = []
    size = target
    for allocation in ordered:
        if size >= target:
            groups.append([])
            size = 0
        groups[-1].append(allocation)
        size += allocation.size
    return groups


def _sort_by_digest(
    backend: Backend,
    groups: Sequence[Sequence[Allocation]],
    skip_unchanged: bool,
    clock: ReleaseClock,
) -> tuple[list[tuple[Allocation, bytes | None]], list[Allocation]]:
    """The stale allocations with their new digests, and the unchanged ones still mapped, both
    largest first. Every group is launched at once, then waited for in order; the unchanged
    allocations found before the first stale one are released at once (no copy is queued yet,
    so no later digest waits behind anything), the others wait to be released under the copies.
    """
    if not skip_unchanged:
        return [(a, None) for group in groups for a in group], []
    if not groups:
        return [], []
    batch = backend.hash_batch()
    indices = [batch.add([a.span for a in group]) for group in groups]
    stale: list[tuple[Allocation, bytes | None]] = []
    unchanged: list[Allocation] = []
    for group, index in zip(groups, indices, strict=True):
        for allocation, digest in zip(group, batch.wait(index), strict=True):
            if _is_stale(allocation, digest):
                stale.append((allocation, digest))
            elif stale:
                unchanged.append(allocation)
            else:
                clock.release(allocation, Policy.HOST)
    return stale, unchanged


def _is_stale(allocation: Allocation, digest: bytes | None) -> bool:
    """Whether the arena copy must be (re)written: no valid copy or digest to trust, a hint, or
    a change."""
    return (
        digest is None
        or allocation.is_dirty
        or not allocation.has_host_copy
        or allocation.digest != digest
    )


class _DiscardThread:
    """Releases ``discards`` (largest first) in a helper thread, started at once. The thread
    touches only these allocations; ``join`` raises what it failed with."""

    def __init__(self, clock: ReleaseClock, discards: Sequence[Allocation]) -> None:
        self._clock, self._discards = clock, discards
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dormant-discard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for allocation in self._discards:
                self._clock.release(allocation, Policy.DISCARD)
        except BaseException as error:  # raised by join(), in the sleeping thread
            self._error = error

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def join_after(self, error: BaseException) -> None:
        """Waits for the thread after ``error`` stopped the sleep; its own failure becomes a
        note on ``error`` (which is what is raised)."""
        self._thread.join()
        if self._error is not None:
            error.add_note(f"releasing the DISCARD allocations also failed: {self._error!r}")
