"""The persistent host arena that HOST-policy bytes are copied to (DESIGN §2.6).

Pinning host memory is what made prior sleeps slow (a fresh pinned buffer at every sleep). The
arena pins its memory once: anonymous memory is page-touched (in parallel) and then registered with
the backend, and it is kept across cycles, so a steady-state sleep only copies.

An allocation owns its region for as long as it lives, so a later sleep of unchanged memory can
skip the copy. Growth adds chunks; it never moves a region.

Growth is slow (first-touching host pages: 0.15-0.35 s/GiB in the VMs measured), so the first
sleep of a process paid ~11 x a steady-state one. ``prepare`` grows the arena ahead of need in
background threads, at lowered priority, and returns at once: the caller (an engine, once its
model is loaded and its graphs captured) knows the bytes early. ``allocate`` and ``release``
first wait for a preparation in flight; a preparation that failed is reported on its
``ArenaPreparation`` and changes nothing (the next sleep grows the arena itself).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dormant.memory import libc
from dormant.memory.backend import Backend
from dormant.memory.errors import HostArenaError
from dormant.memory.ranges import RangeAllocator, align_up

BACKGROUND_NICE = 10  # how much lower than the engine's threads the preparing threads run

_REGION_ALIGNMENT = 4096


@dataclass(frozen=True)
class Region:
    """``nbytes`` of arena at ``address``, inside chunk ``chunk``."""

    chunk: int
    offset: int
    nbytes: int
    address: int


@dataclass
class _Chunk:
    address: int
    size: int
    ranges: RangeAllocator


class ArenaPreparation:
    """Host memory being populated and pinned in the background (``HostArena.prepare``).

    ``nbytes`` is what it adds to the arena. ``wait()`` blocks until it is done and raises what
    made it fail; ``seconds`` is how long it took (None while it runs), ``error`` its failure.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Waits for the preparation; raises its error, or TimeoutError after ``timeout`` s."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the host arena preparation is still running after {timeout} s")
        if self.error is not None:
            raise self.error

    def _finish(self, seconds: float, error: BaseException | None) -> None:
        self.seconds, self.error = seconds, error
        self._done.set()


class HostArena:
    """Pinned host memory handed out as regions.

    Invariant: every chunk is populated and pinned for as long as it exists; a region is valid
    until ``free`` or ``release``. A preparation's chunks join the arena only once all of them
    are made (its thread appends them; nothing else reads them before ``_settle``).
    """

    def __init__(self, backend: Backend, chunk_bytes: int = 1 << 30, num_threads: int = 0) -> None:
        self._backend = backend
        self.chunk_bytes = chunk_bytes
        self.num_threads = num_threads or min(16, os.cpu_count() or 1)
        self._chunks: list[_Chunk | None] = []
        self._preparation: ArenaPreparation | None = None

    @property
    def capacity_bytes(self) -> int:
        return sum(c.size for c in self._chunks if c is not None)

    @property
    def used_bytes(self) -> int:
        return sum(c.ranges.allocated_bytes for c in self._chunks if c is not None)

    @property
    def num_chunks(self) -> int:
        return sum(c is not None for c in self._chunks)

    @property
    def preparation(self) -> ArenaPreparation | None:
        """The last preparation started (done or not), if any."""
        return self._preparation

    def prepare(self, sizes: list[int], num_threads: int = 0) -> ArenaPreparation:
        """Starts growing the arena, in background threads, so that regions of ``sizes`` fit
        beside what it already holds; returns at once. Waits for a preparation in flight first.
        ``num_threads`` defaults to half the cores (at most 8), run ``BACKGROUND_NICE`` lower."""
        self._settle()
        plan = _chunk_plan([align_up(n, _REGION_ALIGNMENT) for n in self._unplaced(sizes)],
                           self.chunk_bytes)  # fmt: skip
        preparation = ArenaPreparation(sum(plan))
        self._preparation = preparation
        if not plan:
            preparation._finish(0.0, None)
            return preparation
        threads = num_threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        worker = threading.Thread(
            target=self._prepare, args=(plan, threads, preparation), name="dormant-arena",
            daemon=True,
        )  # fmt: skip
        worker.start()
        return preparation

    def allocate(self, sizes: list[int]) -> list[Region]:
        """One region per size, in order, growing the arena if needed. All or nothing."""
        self._settle()
        regions: list[Region | None] = [None] * len(sizes)
        try:
            for attempt in range(3):
                missing = sorted(
                    (i for i, r in enumerate(regions) if r is None), key=lambda i: -sizes[i]
                )
                if attempt:
                    self._grow([sizes[i] for i in missing])
                for i in missing:
                    regions[i] = self._allocate_existing(sizes[i])
                if all(r is not None for r in regions):
                    return [r for r in regions if r is not None]
            raise HostArenaError("host arena could not place its regions after growing")
        except BaseException:
            for region in regions:
                if region is not None:
                    self.free(region)
            raise

    def free(self, region: Region) -> None:
        chunk = self._chunks[region.chunk]
        assert chunk is not None, "region of a released chunk"
        chunk.ranges.free(region.offset)

    def release(self) -> None:
        """Unpins and returns every chunk. Precondition: no region is in use."""
        self._settle()
        if self.used_bytes:
            raise HostArenaError(f"cannot release the arena: {self.used_bytes} bytes are in use")
        for chunk in self._chunks:
            if chunk is not None:
                self._backend.unpin(chunk.address, chunk.size)
                libc.munmap(chunk.address, chunk.size)
        self._chunks.clear()

    def _allocate_existing(self, nbytes: int) -> Region | None:
        """Best fit: the smallest free span of any chunk that holds ``nbytes``. The chunks are
        sized for the allocations a level offloads (``prepare``), so first fit let a smaller
        sleep's region (the runtime's, at level 2) take the room of a weights-sized chunk, and
        the next level-1 sleep grew and pinned that much again."""
        spans = (
            (span, index)
            for index, chunk in enumerate(self._chunks)
            if chunk is not None and (span := chunk.ranges.tightest_fit(nbytes)) is not None
        )
        best = min(spans, default=None)
        if best is None:
            return None
        index = best[1]
        chunk = self._chunks[index]
        assert chunk is not None
        offset = chunk.ranges.allocate(nbytes, best_fit=True)
        assert offset is not None, "the span that was measured holds it"
        return Region(index, offset, nbytes, chunk.address + offset)

    def _unplaced(self, sizes: list[int]) -> list[int]:
        """The sizes (largest first) that would not fit in the arena's free space as it is."""
        placed, missing = [], []
        for nbytes in sorted(sizes, reverse=True):
            region = self._allocate_existing(nbytes)
            (missing.append(nbytes) if region is None else placed.append(region))
        for region in placed:
            self.free(region)
        return missing

    def _settle(self) -> None:
        """Waits for a preparation in flight, whose chunks are then the arena's. Its failure
        stays on the preparation: the caller grows the arena itself if it still needs to."""
        if self._preparation is not None:
            self._preparation._done.wait()

    def _prepare(self, plan: list[int], num_threads: int, preparation: ArenaPreparation) -> None:
        start, error = time.perf_counter(), None
        try:
            self._chunks.extend(self._make_chunks(plan, num_threads, _lower_priority))
        except BaseException as failure:  # kept on the preparation for wait() and status()
            error = failure
        preparation._finish(time.perf_counter() - start, error)

    def _grow(self, sizes: list[int]) -> None:
        """Adds chunks that hold ``sizes``, populated and pinned in parallel threads."""
        plan = _chunk_plan([align_up(n, _REGION_ALIGNMENT) for n in sizes], self.chunk_bytes)
        self._chunks.extend(self._make_chunks(plan, self.num_threads))

    def _make_chunks(
        self, plan: list[int], num_threads: int, initializer: Callable[[], None] | None = None
    ) -> list[_Chunk]:
        """Chunks of ``plan``'s sizes. All or nothing: if one chunk fails, the ones made are
        given back before the error is raised."""
        with ThreadPoolExecutor(num_threads, initializer=initializer) as pool:
            futures = [pool.submit(self._make_chunk, size) for size in plan]
        made = [f.result() for f in futures if f.exception() is None]
        errors = [error for f in futures if (error := f.exception()) is not None]
        if errors:
            for chunk in made:
                self._backend.unpin(chunk.address, chunk.size)
                libc.munmap(chunk.address, chunk.size)
            raise errors[0]
        return made

    def _make_chunk(self, size: int) -> _Chunk:
        address = libc.map_anonymous(size)
        try:
            libc.populate(address, size)
            self._backend.pin(address, size)
        except BaseException:
            libc.munmap(address, size)
            raise
        return _Chunk(address, size, RangeAllocator(size, _REGION_ALIGNMENT))


def _lower_priority() -> None:
    """Runs this thread ``BACKGROUND_NICE`` below the engine's (Linux: per-thread niceness)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
    except OSError:  # a scheduling hint only: without it the preparation is just less polite
        pass


def _chunk_plan(sizes: list[int], chunk_bytes: int) -> list[int]:
    """Chunk sizes that hold ``sizes`` by first fit: regions larger than a chunk get their own."""
    chunks: list[int] = []
    room: list[int] = []
    for nbytes in sorted(sizes, reverse=True):
        for i, free in enumerate(room):
            if free >= nbytes:
                room[i] -= nbytes
                break
        else:
            size = max(chunk_bytes, nbytes)
            chunks.append(size)
            room.append(size - nbytes)
    # A chunk is only as large as what it holds (rounded to a page): don't pin what nobody needs.
    return [
        align_up(size - free, _REGION_ALIGNMENT) for size, free in zip(chunks, room, strict=True)
    ]
