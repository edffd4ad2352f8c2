"""The sender's IPC ref-counters, released from a file mapped once instead of once per bucket.

torch's producer frees a block it shared only when every consumer dropped the block's counters:
each ``reduce_tensor`` of a CUDA tensor takes a new int64 slot in a ref-counter file (set to 1;
the file is shared memory, ``/torch_<pid>_<random>_<n>``, of ``REF_COUNTER_SLOTS`` slots behind
``at::RefcountedMapAllocator``'s 64-byte header), and the consumer decrements it once: when the
storage it opened dies, or at once when it already held that storage
(``rebuild_cuda_tensor``'s cache hit calls ``_release_ipc_counter``). That call maps the file,
decrements the slot (not atomically) and unmaps it, on every bucket of a reused buffer.
``RefCounterFiles`` keeps each file it released into mapped until ``close()`` and decrements
the slot in place, the same write under a lock (ranks may be threads of one process). A name
that is not a torch ref-counter file it can map falls back to torch's release.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from collections.abc import Callable

import torch

from dormant.worker.transfer_errors import WeightTransferError

REF_COUNTER_SLOTS = 10000  # torch::CUDA_IPC_REF_COUNTER_FILE_SIZE
HEADER_BYTES = 64  # at::RefcountedMapAllocator's header (its own refcount) before the slots
FILE_BYTES = HEADER_BYTES + 8 * REF_COUNTER_SLOTS
MAX_FILES = 8  # files kept mapped; the oldest is unmapped first
_NAME = re.compile(rb"/[A-Za-z0-9_.-]{1,200}")  # a shm_open name: one leading slash, no other


def _torch_release(name: bytes, slot: int) -> None:
    torch.UntypedStorage._release_ipc_counter_cuda(name, slot)


class RefCounterFiles:
    """Ref-counter files by name, each mapped at its first release (``root``: where shm_open
    names live); ``num_mapped`` counts the files mapped, ``num_released`` the slots released."""

    def __init__(
        self, root: str = "/dev/shm", fallback: Callable[[bytes, int], None] = _torch_release
    ) -> None:
        self._root, self._fallback = root, fallback
        self._files: dict[bytes, tuple[mmap.mmap, memoryview, memoryview]] = {}
        self._lock = threading.Lock()
        self.num_mapped = self.num_released = 0

    @property
    def num_open(self) -> int:
        return len(self._files)

    def release(self, name: bytes, slot: int) -> None:
        """Decrements slot ``slot`` of file ``name`` once, as torch's ``_release_ipc_counter``.
        Raises ``WeightTransferError`` for a slot outside the file (nothing is written)."""
        if type(slot) is not int or not 0 <= slot < REF_COUNTER_SLOTS:
            raise WeightTransferError(
                f"the sender's ref-counter slot {slot!r} is outside its file (0 .. "
                f"{REF_COUNTER_SLOTS - 1}): the payload is corrupted; nothing was written"
            )
        with self._lock:
            mapped = self._files.get(name)
            if mapped is None:
                mapped = self._map(name)
            if mapped is None:
                self._fallback(name, slot)
            else:
                counters = mapped[2]
                counters[slot] -= 1
            self.num_released += 1

    def _map(self, name: bytes) -> tuple[mmap.mmap, memoryview, memoryview] | None:
        if type(name) is not bytes or _NAME.fullmatch(name) is None:
            return None
        try:
            fd = os.open(os.path.join(self._root, name[1:].decode()), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < FILE_BYTES:
                return None
            file = mmap.mmap(fd, FILE_BYTES)
        finally:
            os.close(fd)
        whole = memoryview(file)
        mapped = (file, whole, whole[HEADER_BYTES:FILE_BYTES].cast("q"))
        while len(self._files) >= MAX_FILES:
            _unmap(self._files.pop(next(iter(self._files))))
        self._files[name] = mapped
        self.num_mapped += 1
        return mapped

    def close(self) -> None:
        """Unmaps every file (the sender's own mapping keeps it)."""
        with self._lock:
            for mapped in self._files.values():
                _unmap(mapped)
            self._files.clear()


def _unmap(mapped: tuple[mmap.mmap, memoryview, memoryview]) -> None:
    file, whole, counters = mapped
    counters.release()
    whole.release()
    file.close()
