"""The copy batch a wake uses: the backend's batch of one copy path, or of both (HYBRID).

``PathCopies`` is a ``CopyBatch`` (backend.py). It opens ``backend.copy_batch(CopyPath.
COPY_ENGINE)`` and/or ``backend.copy_batch(CopyPath.SM)``; the backend runs the two on streams
of their own, so a HYBRID batch's halves run concurrently. Under HYBRID each copy is split
(``split_copy``): the copy engines take its head, the SM kernels its last ``sm_fraction`` (cut at
``SPLIT_ALIGNMENT``; a copy too small to cut goes whole to the copy engines). It counts the bytes
each path was given, for the wake's report.

``wait(i)`` returns once every part of copy ``i`` has landed; ``wait_all`` waits for both
batches even when waiting for the first one fails (no copy may outlive a rolled-back wake).
"""

from __future__ import annotations

from dormant.memory.backend import Backend, Copy, CopyBatch
from dormant.memory.copy_path import CopyPath

SPLIT_ALIGNMENT = 64 << 10


def split_copy(copy: Copy, sm_fraction: float) -> tuple[Copy | None, Copy | None]:
    """(copy-engine part, SM part) of ``copy`` under HYBRID; either is None when empty."""
    sm_bytes = int(copy.nbytes * sm_fraction) // SPLIT_ALIGNMENT * SPLIT_ALIGNMENT
    engine_bytes = copy.nbytes - sm_bytes
    engine = Copy(copy.dst, copy.src, engine_bytes) if engine_bytes else None
    sm = Copy(copy.dst + engine_bytes, copy.src + engine_bytes, sm_bytes) if sm_bytes else None
    return engine, sm


class PathCopies:
    """Copies by ``path``; ``bytes_by_path`` says how many bytes each path was given."""

    def __init__(self, backend: Backend, path: CopyPath, sm_fraction: float = 0.5) -> None:
        self.path = path
        self._sm_fraction = sm_fraction
        self._engine: CopyBatch | None = None
        self._sm: CopyBatch | None = None
        if path is not CopyPath.SM:
            self._engine = backend.copy_batch(CopyPath.COPY_ENGINE)
        if path is not CopyPath.COPY_ENGINE:
            self._sm = backend.copy_batch(CopyPath.SM)
        self._parts: list[tuple[int | None, int | None]] = []  # copy -> (engine, SM) index
        self.bytes_by_path = {CopyPath.COPY_ENGINE: 0, CopyPath.SM: 0}

    def add(self, copy: Copy) -> int:
        if self.path is CopyPath.HYBRID:
            engine, sm = split_copy(copy, self._sm_fraction)
        else:
            engine, sm = (None, copy) if self.path is CopyPath.SM else (copy, None)
        engine_index = sm_index = None
        if engine is not None:
            assert self._engine is not None
            engine_index = self._engine.add(engine)
            self.bytes_by_path[CopyPath.COPY_ENGINE] += engine.nbytes
        if sm is not None:
            assert self._sm is not None
            sm_index = self._sm.add(sm)
            self.bytes_by_path[CopyPath.SM] += sm.nbytes
        self._parts.append((engine_index, sm_index))
        return len(self._parts) - 1

    def wait(self, index: int) -> None:
        engine_index, sm_index = self._parts[index]
        if engine_index is not None:
            assert self._engine is not None
            self._engine.wait(engine_index)
        if sm_index is not None:
            assert self._sm is not None
            self._sm.wait(sm_index)

    def wait_all(self) -> None:
        try:
            if self._engine is not None:
                self._engine.wait_all()
        finally:
            if self._sm is not None:
                self._sm.wait_all()
