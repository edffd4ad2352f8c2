"""The stand-ins ``ipc_host.py`` receives through on the CPU, and torch's own receive path.

``StandInDriver`` maps a "handle" to a CPU buffer when ``IpcHandles`` opens it, and keeps a real
ref-counter file laid out as torch's (in /dev/shm, where torch's are), one slot per share;
``SharedBuffer`` pickles a tensor as a trainer's CUDA tensor is (``rebuild_cuda_tensor`` and its
15 arguments). ``TorchStorage`` and ``torch_rebuild`` run torch's ``rebuild_cuda_tensor`` on a
storage its ``shared_cache`` holds, as the receiver did before it kept its own map: the cache,
a ``TypedStorage`` and ``_rebuild_tensor``, and the counter release as torch's C++ does it per
call (map the file, decrement the slot, unmap). ``engine_receiving_from`` builds a CPU engine
whose rank receives through the stand-in driver.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import tempfile
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.multiprocessing import reductions

from dormant import LLM
from dormant.executors import UniprocExecutor
from dormant.models import ModelConfig
from dormant.worker.ipc_counters import FILE_BYTES, HEADER_BYTES, REF_COUNTER_SLOTS, RefCounterFiles
from dormant.worker.ipc_handles import IpcHandles
from dormant.worker.ipc_receiver import IpcReceiver
from dormant.worker.ipc_weights import pack_flattened_bucket

HANDLE = b"sender-buffer"


class StandInDriver:
    """Maps a handle to its CPU buffer as a new storage (``open_storage`` stands in for torch's
    ``_new_shared_cuda``); the sender's ref-counter file is a real one, laid out as torch's, in
    /dev/shm (where torch's are), one slot per share as ``reduce_tensor`` takes them."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = np.zeros(nbytes, dtype=np.uint8)
        self.root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.counter_name = b"/torch_%d_ipc_host_0" % os.getpid()
        self.path = os.path.join(self.root, self.counter_name[1:].decode())
        with open(self.path, "wb") as file:
            file.write(bytes(FILE_BYTES))
        self.slots = np.memmap(self.path, np.int64, "r+", HEADER_BYTES, (REF_COUNTER_SLOTS,))
        self.num_shared = 0

    def share(self) -> int:
        slot = self.num_shared % REF_COUNTER_SLOTS
        self.slots[slot] = 1
        self.num_shared += 1
        return slot

    def open_storage(self, *args: Any) -> torch.UntypedStorage:
        return torch.from_numpy(self.buffer).untyped_storage()

    def handles(self) -> IpcHandles:
        return IpcHandles(self.open_storage, RefCounterFiles(self.root), lambda d, e: None)

    def close(self) -> None:
        os.unlink(self.path)


def engine_receiving_from(driver: StandInDriver, config: ModelConfig) -> tuple[LLM, IpcReceiver]:
    """A CPU engine of ``config`` (one rank, in-process, as a one-GPU engine runs) whose rank
    receives through ``driver``, and that rank's receiver."""
    llm = LLM(config, max_model_len=256, max_num_seqs=4, enforce_eager=True, device="cpu",
              skip_tokenizer_init=True, kv_cache_memory_bytes=16 << 20)  # fmt: skip
    executor = llm.llm_engine.executor
    assert isinstance(executor, UniprocExecutor)
    receiver = executor.worker.refitter.ipc = IpcReceiver(driver.handles())
    return llm, receiver


class SharedBuffer:
    """Pickles as a trainer's CUDA tensor does: ``rebuild_cuda_tensor`` and its 15 arguments."""

    def __init__(self, tensor: Tensor, driver: StandInDriver) -> None:
        self.tensor, self.counter, self.slot = tensor, driver.counter_name, driver.share()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reductions.rebuild_cuda_tensor, rebuild_args(self.tensor, self.counter, self.slot)


def rebuild_args(t: Tensor, counter: bytes, slot: int) -> tuple[Any, ...]:
    return (
        Tensor, t.shape, t.stride(), t.storage_offset(), torch.UntypedStorage, t.dtype, 0, HANDLE,
        t.untyped_storage().nbytes(), 0, False, counter, slot, b"event-handle" * 5, True,
    )  # fmt: skip


def serialize(driver: StandInDriver, bucket: list[tuple[str, Tensor]]) -> bytes:
    payload = pack_flattened_bucket(torch.from_numpy(driver.buffer), bucket)
    stream = io.BytesIO()
    shared = SharedBuffer(payload["flattened_tensor"], driver)
    pickle.Pickler(stream).dump({"flattened_tensor": shared, "metadata": payload["metadata"]})
    return stream.getvalue()


class TorchStorage(torch.UntypedStorage):
    """The storage class torch's own held-storage path is given, its C++ counter release as
    ``_release_ipc_counter`` runs it per call: map the file, decrement the slot, unmap."""

    root = ""

    @classmethod
    def _release_ipc_counter(cls, name: bytes, slot: int, device: Any = None) -> None:
        fd = os.open(os.path.join(cls.root, name[1:].decode()), os.O_RDWR)
        try:
            os.fstat(fd)
            with mmap.mmap(fd, FILE_BYTES) as file:
                view = memoryview(file)[HEADER_BYTES:].cast("q")
                view[slot] -= 1
                view.release()
        finally:
            os.close(fd)


def torch_rebuild(*args: Any) -> Tensor:
    """torch's ``rebuild_cuda_tensor`` with ``TorchStorage``'s counter release."""
    return reductions.rebuild_cuda_tensor(*args[:4], TorchStorage, *args[5:])


def hold_in_torchs_cache(driver: StandInDriver) -> tuple[Any, torch.UntypedStorage]:
    """Registers the sender's buffer in torch's ``shared_cache``, as torch does once it opened
    the handle (on the CPU nothing can open it); returns the key and the storage to keep."""
    TorchStorage.root = driver.root
    storage = torch.from_numpy(driver.buffer).untyped_storage()
    reductions.shared_cache[(HANDLE, 0)] = reductions.StorageWeakRef(storage)
    return (HANDLE, 0), storage


def held_rebuild(driver: StandInDriver, calls: int = 3000) -> dict[str, list[float]]:
    """One rebuild of a held storage (a reused buffer's every bucket but the first), torch's
    ``rebuild_cuda_tensor`` (its cache, ``TypedStorage``, ``_rebuild_tensor``, the counter
    release above) against ``IpcHandles``' (its map, a view, the counter in the mapped file);
    the event wait is not in either (a driver call on the GPU)."""
    tensor = torch.from_numpy(driver.buffer)[: 1 << 20]
    key, _storage = hold_in_torchs_cache(driver)
    handles = driver.handles()
    handles.rebuild_cuda_tensor(*rebuild_args(tensor, driver.counter_name, driver.share()))
    times: dict[str, list[float]] = {"held rebuild, torch's": [], "held rebuild, ours": []}
    for _ in range(calls):
        for stage, rebuild in (
            ("held rebuild, torch's", torch_rebuild),
            ("held rebuild, ours", handles.rebuild_cuda_tensor),
        ):
            args = rebuild_args(tensor, driver.counter_name, driver.share())
            t0 = time.perf_counter()
            rebuild(*args)
            times[stage].append(time.perf_counter() - t0)
    del reductions.shared_cache[key]
    handles.release()
    return times
