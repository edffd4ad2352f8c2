"""The byte-moving halves of sleep and wake, over a chosen set of allocations.

The tag machine (``tag_machine.py``) decides *which* allocations change state; these functions
make the change in the order DESIGN §2.3 requires, overlapping driver work with the copies,
record every step as soon as it lands, and report timings.

Sleep::

    synchronize the device           never copy or unmap under running kernels
    place host copies in the arena   (may grow it, or wait for its background preparation: an
                                     error here changes nothing)
    hash MAPPED HOST allocations     in groups of about 1/8 of the bytes, largest first, launched
                                     back to back (hash_groups), all waited for before anything
                                     else: unchanged since their last offload → no copy
    start the D2H copies             one per stale allocation, largest first, asynchronous; each
                                     one's host copy is marked invalid before its copy starts
    release DISCARD + unchanged      while the copies run, largest first
    release each stale allocation    as soon as its own copy has landed (host copy now valid)

Why every digest is known before the first copy starts: a group's digests come back by a small
device-to-host copy, which (inferred from the timings) queues behind the device-to-host copies
already running. On the H200 (2026-12-01b), a sleep that started each group's copies as soon as
that group's digests landed waited 140 ms of its 175 ms for digests (1.13 x the copy limit);
hashing all 8 GiB first costs ~3 ms (159 ms, 1.03 x, in 2026-12-01 run 4). Nor are unchanged
allocations released while later groups hash: the releases ran no faster under the hash kernels
(8 GiB unchanged: 11.5 ms, against 10.1 ms with every hash waited for first).

Releasing one allocation is two recorded steps: unmap (→ UNMAPPED, handle kept), then release
(→ OFFLOADED or DISCARDED). An allocation that is already UNMAPPED only retries the release.

Wake::

    map each allocation, in order    UNMAPPED: its own handle again (contents intact); others: a
                                     new handle, starting the H2D copy as soon as it is mapped
    on any failure                   wait for the copies, unmap + release what this call created
                                     (unmap only, for a handle the allocation already held), leave
                                     every state as it was, raise
    poison DISCARD remaps (debug)    then wait for the copies, then mark MAPPED

Nothing is marked MAPPED until every allocation is mapped and restored, so a failed wake is
invisible; starting copies before the last map only overlaps work that a rollback throws away.
An OFFLOADED allocation without a valid host copy (unreachable with this ordering) comes back
zeroed (poisoned in poison mode) and is listed in ``WakeReport.lost``: never silent garbage.

Out of scope: a second driver failure while a failed wake is being rolled back is raised in place
of the first, and the allocations that rollback had not reached yet are not described truthfully.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dormant.memory.allocation import Allocation, State
from dormant.memory.arena import HostArena, Region
from dormant.memory.backend import Backend, Copy, CopyBatch
from dormant.memory.errors import OutOfMemoryError, WakeOutOfMemoryError
from dormant.memory.policy import Policy
from dormant.memory.status import SleepReport, WakeReport

POISON_BYTE = 0xFF
HASH_GROUPS = 8  # a sleep hashes its HOST allocations in about this many groups,
HASH_GROUP_MIN_BYTES = 64 << 20  # each of at least this many bytes (read at each sleep)
_WAKE_ORDER = {State.OFFLOADED: 0, State.UNMAPPED: 1, State.DISCARDED: 2}


def sleep_allocations(
    backend: Backend,
    arena: HostArena,
    host: Sequence[Allocation],
    discard: Sequence[Allocation],
    *,
    skip_unchanged: bool,
) -> SleepReport:
    """Offloads ``host`` and discards ``discard``.

    Preconditions: each allocation is MAPPED, or UNMAPPED on its way into the same policy (a HOST
    one then has a valid host copy). A MAPPED HOST allocation whose content hash equals the digest
    of its valid arena copy is not copied again. An error before the copies start leaves every
    allocation as it was; a later one leaves each allocation as its last landed step recorded.
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

    groups = hash_groups([a for a in host if a.state is State.MAPPED])
    digests = _hash_all(backend, groups) if skip_unchanged else [None] * len(groups)
    t_hash = time.perf_counter()

    hashed = [a for group in groups for a in group]  # largest first
    stale = [(a, d) for a, d in zip(hashed, _flat(groups, digests), strict=True) if _is_stale(a, d)]
    stale_ids = {id(a) for a, _ in stale}
    batch = backend.copy_batch()
    try:
        for allocation, _ in stale:
            allocation.has_host_copy, allocation.digest = False, None  # being overwritten
            batch.add(Copy(_region(allocation).address, allocation.va, allocation.size))
        for allocation in sorted(discard, key=lambda a: -a.size):
            _release(backend, allocation, Policy.DISCARD)
        for allocation in hashed:
            if id(allocation) not in stale_ids:  # unchanged: its arena copy is valid
                _release(backend, allocation, Policy.HOST)
        for allocation in host:
            if allocation.state is State.UNMAPPED:  # a failed sleep's: its copy is valid
                _release(backend, allocation, Policy.HOST)
        for index, (allocation, digest) in enumerate(stale):
            batch.wait(index)
            allocation.has_host_copy, allocation.digest = True, digest
            allocation.is_dirty = False
            _release(backend, allocation, Policy.HOST)
        batch.wait_all()
    except BaseException as error:
        _drain(batch, error)
        raise
    t_end = time.perf_counter()

    copied = sum(a.size for a, _ in stale)
    return SleepReport(
        total_s=t_end - t0,
        sync_s=t_sync - t0,
        arena_s=t_arena - t_sync,
        hash_s=t_hash - t_arena,
        copy_s=t_end - t_hash,  # copies, with the releases overlapped under them
        bytes_copied=copied,
        bytes_skipped=sum(a.size for a in hashed) - copied,
        bytes_released=sum(a.size for a in (*host, *discard)),
    )


def hash_groups(allocations: Sequence[Allocation]) -> list[list[Allocation]]:
    """``allocations``, largest first, cut into about ``HASH_GROUPS`` groups of similar bytes
    (at least ``HASH_GROUP_MIN_BYTES`` each): launched one after another, so that the device
    hashes the first group while the host prepares the next one's table."""
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


def _hash_all(backend: Backend, groups: Sequence[Sequence[Allocation]]) -> list[list[bytes] | None]:
    """Every group's digests: all groups launched, then all waited for (no copy is queued yet,
    so no digest download waits behind one)."""
    if not groups:
        return []
    batch = backend.hash_batch()
    indices = [batch.add([a.span for a in group]) for group in groups]
    return [list(batch.wait(index)) for index in indices]


def _flat(
    groups: Sequence[Sequence[Allocation]], digests: Sequence[list[bytes] | None]
) -> list[bytes | None]:
    """One digest per allocation of ``groups``, in order (None for a group not hashed)."""
    flat: list[bytes | None] = []
    for group, group_digests in zip(groups, digests, strict=True):
        flat.extend([None] * len(group) if group_digests is None else group_digests)
    return flat


def wake_allocations(
    backend: Backend, allocations: Sequence[Allocation], *, poison: bool
) -> WakeReport:
    """Maps every allocation (none MAPPED) at its own VA, then restores or poisons it. All or
    nothing.

    On any failure the memory mapped by this call is unmapped, what it created is released, every
    state is left as it was, and the error is raised (out-of-memory as WakeOutOfMemoryError with
    the byte counts).
    """
    t0 = time.perf_counter()
    # Offloaded allocations first: their copies start while the rest is being mapped.
    ordered = sorted(allocations, key=lambda a: _WAKE_ORDER[a.state])
    created: list[tuple[Allocation, int]] = []  # new handles, mapped
    remapped: list[Allocation] = []  # UNMAPPED allocations whose own handle is mapped again
    lost: list[Allocation] = []
    batch = backend.copy_batch()
    try:
        for allocation in ordered:
            if allocation.state is State.UNMAPPED:
                backend.map(allocation.va, allocation.size, _handle(allocation))
                remapped.append(allocation)
                continue
            handle = backend.create(allocation.size)
            try:
                backend.map(allocation.va, allocation.size, handle)
            except BaseException:
                backend.release(handle)
                raise
            created.append((allocation, handle))
            if allocation.state is State.OFFLOADED and allocation.has_host_copy:
                batch.add(Copy(allocation.va, _region(allocation).address, allocation.size))
            elif allocation.state is State.OFFLOADED:
                lost.append(allocation)
        t_map = time.perf_counter()
        refilled = [a.span for a in ordered if a.state is State.DISCARDED] + [a.span for a in lost]
        if poison and refilled:
            backend.fill(refilled, POISON_BYTE)
        batch.wait_all()
    except BaseException as error:
        _roll_back(backend, batch, created, remapped, error)
        if isinstance(error, OutOfMemoryError):
            raise _wake_oom(backend, allocations) from error
        raise
    t_end = time.perf_counter()
    copied = sum(a.size for a, _ in created if a.state is State.OFFLOADED and a not in lost)
    for allocation, handle in created:
        allocation.handle, allocation.state = handle, State.MAPPED
    for allocation in remapped:
        allocation.state, allocation.pending = State.MAPPED, None
    return WakeReport(
        total_s=t_end - t0,
        map_s=t_map - t0,  # mapping, with the copies already running under it
        copy_s=t_end - t_map,
        bytes_mapped=sum(a.size for a in allocations),
        bytes_copied=copied,
        lost=_bytes_by_tag(lost),
    )


def _is_stale(allocation: Allocation, digest: bytes | None) -> bool:
    """Whether the arena copy must be (re)written: no valid copy or digest to trust, a hint, or
    a change."""
    return (
        digest is None
        or allocation.is_dirty
        or not allocation.has_host_copy
        or allocation.digest != digest
    )


def _release(backend: Backend, allocation: Allocation, policy: Policy) -> None:
    """Unmap (unless already UNMAPPED), then release; each step recorded as it lands."""
    if allocation.state is State.MAPPED:
        backend.unmap(allocation.va, allocation.size)
        allocation.state, allocation.pending = State.UNMAPPED, policy
    backend.release(_handle(allocation))
    allocation.handle, allocation.pending = None, None
    allocation.state = State.OFFLOADED if policy is Policy.HOST else State.DISCARDED


def _drain(batch: CopyBatch, error: BaseException) -> None:
    """Waits for the copies of a failed sleep or wake, so none outlives its batch; a failure to
    wait is added to ``error`` as a note (never swallowed), and ``error`` is what is raised."""
    try:
        batch.wait_all()
    except Exception as wait_error:
        error.add_note(f"waiting for the copies after that failed also failed: {wait_error!r}")


def _roll_back(
    backend: Backend,
    batch: CopyBatch,
    created: list[tuple[Allocation, int]],
    remapped: list[Allocation],
    error: BaseException,
) -> None:
    _drain(batch, error)  # no copy may still be writing into memory about to be released
    for allocation, handle in created:
        backend.unmap(allocation.va, allocation.size)
        backend.release(handle)
    for allocation in remapped:
        backend.unmap(allocation.va, allocation.size)  # it stays UNMAPPED, holding its handle


def _wake_oom(backend: Backend, allocations: Sequence[Allocation]) -> WakeOutOfMemoryError:
    needed = sum(a.size for a in allocations)
    free, _ = backend.memory_info()
    return WakeOutOfMemoryError(
        f"wake needs {needed:,} bytes for {len(allocations)} allocations but only {free:,} bytes "
        "are free; nothing was mapped and every tag is still asleep. Free device memory (e.g. the "
        "trainer's) and call wake_up again.",
        bytes_requested=needed,
        bytes_free=free,
    )


def _bytes_by_tag(allocations: Sequence[Allocation]) -> tuple[tuple[str, int], ...]:
    totals: dict[str, int] = {}
    for allocation in allocations:
        totals[allocation.tag] = totals.get(allocation.tag, 0) + allocation.size
    return tuple(totals.items())


def _handle(allocation: Allocation) -> int:
    assert allocation.handle is not None, "a MAPPED or UNMAPPED allocation holds its handle"
    return allocation.handle


def _region(allocation: Allocation) -> Region:
    assert allocation.region is not None, "a HOST allocation always has an arena region"
    return allocation.region
