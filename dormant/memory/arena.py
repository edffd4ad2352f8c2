"""The persistent host arena that HOST-policy bytes are copied to (DESIGN §2.6).

Pinning host memory is what made prior sleeps slow (a fresh pinned buffer at every sleep). The
arena pins its memory once: anonymous memory is page-touched (in parallel) and then registered with
the backend, and it is kept across cycles, so a steady-state sleep only copies.

An allocation owns its region for as long as it lives, so a later sleep of unchanged memory can
skip the copy. Growth adds chunks; it never moves a region.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dormant.memory import libc
from dormant.memory.backend import Backend
from dormant.memory.errors import HostArenaError
from dormant.memory.ranges import RangeAllocator, align_up

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


class HostArena:
    """Pinned host memory handed out as regions.

    Invariant: every chunk is populated and pinned for as long as it exists; a region is valid
    until ``free`` or ``release``.
    """

    def __init__(self, backend: Backend, chunk_bytes: int = 1 << 30, num_threads: int = 0) -> None:
        self._backend = backend
        self.chunk_bytes = chunk_bytes
        self.num_threads = num_threads or min(16, os.cpu_count() or 1)
        self._chunks: list[_Chunk | None] = []

    @property
    def capacity_bytes(self) -> int:
        return sum(c.size for c in self._chunks if c is not None)

    @property
    def used_bytes(self) -> int:
        return sum(c.ranges.allocated_bytes for c in self._chunks if c is not None)

    @property
    def num_chunks(self) -> int:
        return sum(c is not None for c in self._chunks)

    def allocate(self, sizes: list[int]) -> list[Region]:
        """One region per size, in order, growing the arena if needed. All or nothing."""
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
        if self.used_bytes:
            raise HostArenaError(f"cannot release the arena: {self.used_bytes} bytes are in use")
        for chunk in self._chunks:
            if chunk is not None:
                self._backend.unpin(chunk.address, chunk.size)
                libc.munmap(chunk.address, chunk.size)
        self._chunks.clear()

    def _allocate_existing(self, nbytes: int) -> Region | None:
        for index, chunk in enumerate(self._chunks):
            if chunk is None:
                continue
            offset = chunk.ranges.allocate(nbytes)
            if offset is not None:
                return Region(index, offset, nbytes, chunk.address + offset)
        return None

    def _grow(self, sizes: list[int]) -> None:
        """Adds chunks that hold ``sizes``: populated and pinned in parallel threads. All or
        nothing: if one chunk fails, the ones made are given back before the error is raised."""
        plan = _chunk_plan([align_up(n, _REGION_ALIGNMENT) for n in sizes], self.chunk_bytes)
        with ThreadPoolExecutor(self.num_threads) as pool:
            futures = [pool.submit(self._make_chunk, size) for size in plan]
        made = [f.result() for f in futures if f.exception() is None]
        errors = [error for f in futures if (error := f.exception()) is not None]
        if errors:
            for chunk in made:
                self._backend.unpin(chunk.address, chunk.size)
                libc.munmap(chunk.address, chunk.size)
            raise errors[0]
        self._chunks.extend(made)

    def _make_chunk(self, size: int) -> _Chunk:
        address = libc.map_anonymous(size)
        try:
            libc.populate(address, size)
            self._backend.pin(address, size)
        except BaseException:
            libc.munmap(address, size)
            raise
        return _Chunk(address, size, RangeAllocator(size, _REGION_ALIGNMENT))


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
