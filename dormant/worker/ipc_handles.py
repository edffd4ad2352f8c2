"""The receiver's own map of opened IPC storages: a held handle costs a view, a counter and a wait.

torch's ``rebuild_cuda_tensor`` on a storage it still has open (its ``shared_cache``, keyed by
(handle, offset)) pays, per bucket of a reused buffer: the cache's lock and weak reference, a
``TypedStorage`` and ``torch._utils._rebuild_tensor`` around it, and ``_release_ipc_counter``,
which maps the sender's ref-counter file, decrements one slot and unmaps it; and it does not wait
on the sender's IPC event (it only does when it opens a handle). ``IpcHandles`` parses the 15
arguments itself and keeps the storages it opened::

    (handle, offset) is           what it does
    ────────────────────────────  ──────────────────────────────────────────────────────────────
    not held (or held at another  opens it (``UntypedStorage._new_shared_cuda``: maps the handle,
    size or device)               waits on the event, keeps this share's counter until the
                                  storage dies)
    held                          views the held storage (``as_strided`` of a base tensor kept
                                  per dtype), releases this share's counter in the mapped file
                                  (``ipc_counters.RefCounterFiles``), waits on this share's event

Each share of a tensor (every bucket, even of the same buffer) has its own counter slot and its
own event: the counter is released exactly once per received entry (the sender frees a block only
when its counters drop), and the event is always waited on before a copy reads the buffer. The
storages of the payload being rebuilt and of the last one are held; ``end_payload`` drops those of
the last that the new one did not reuse (the sender sent a new handle: the old one closes),
``release`` drops all and unmaps the counter files. An empty storage, or another torch's argument
list, goes to torch's own ``rebuild_cuda_tensor``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing import reductions

from dormant.worker.cuda_streams import current_stream
from dormant.worker.ipc_counters import RefCounterFiles
from dormant.worker.transfer_errors import WeightTransferError

NUM_REBUILD_ARGS = 15  # torch.multiprocessing.reductions.reduce_tensor's CUDA arguments
OpenStorage = Callable[[int, bytes, int, int, bytes, int, bytes, bool], torch.UntypedStorage]


def open_shared_cuda(*args: Any) -> torch.UntypedStorage:
    """torch's ``_new_shared_cuda`` (device, handle, size, offset, counter, slot, event, sync)."""
    torch.cuda._lazy_init()
    return torch.UntypedStorage._new_shared_cuda(*args)


def wait_on_ipc_event(device: int, event_handle: bytes) -> None:
    torch.cuda.Event.from_ipc_handle(device, event_handle).wait(current_stream(device))


class _Held:
    """An opened storage and its base tensors (one per dtype it was viewed as)."""

    __slots__ = ("bases", "device", "nbytes", "storage")

    def __init__(self, storage: torch.UntypedStorage, nbytes: int, device: int) -> None:
        self.storage, self.nbytes, self.device = storage, nbytes, device
        self.bases: dict[torch.dtype, Tensor] = {}

    def view(self, dtype: torch.dtype, size: Any, stride: Any, offset: int) -> Tensor:
        base = self.bases.get(dtype)
        if base is None:
            storage = self.storage
            base = torch.empty(0, dtype=dtype, device=storage.device).set_(storage)
            self.bases[dtype] = base
        return base.as_strided(size, stride, offset)  # checks the bounds of the storage


class IpcHandles:
    """Rebuilds CUDA tensors through its own map of opened storages (see above).
    ``num_opened`` / ``num_reused`` count rebuilds that opened a handle / found it held."""

    def __init__(
        self,
        open_storage: OpenStorage = open_shared_cuda,
        counters: RefCounterFiles | None = None,
        wait_on_event: Callable[[int, bytes], None] = wait_on_ipc_event,
        rebuild: Callable[..., Tensor] = reductions.rebuild_cuda_tensor,
    ) -> None:
        self._open, self._wait_on_event, self._rebuild = open_storage, wait_on_event, rebuild
        self.counters = counters if counters is not None else RefCounterFiles()
        self._held: dict[tuple[bytes, int], _Held] = {}  # the last payload's storages
        self._current: dict[tuple[bytes, int], _Held] = {}  # the payload being rebuilt's
        self.num_opened = self.num_reused = 0

    @property
    def num_held(self) -> int:
        return len(self._held)

    def rebuild_cuda_tensor(self, *args: Any) -> Tensor:
        """Raises ``WeightTransferError`` for arguments of the wrong types (nothing is held,
        released or waited on)."""
        if len(args) != NUM_REBUILD_ARGS or args[7] is None or args[8] == 0:
            return self._rebuild(*args)  # another torch's arguments, or an empty storage
        (cls, size, stride, offset, _, dtype, device, handle, nbytes, storage_offset,
         requires_grad, counter, slot, event, sync) = args  # fmt: skip
        _check_args(cls, dtype, device, handle, nbytes, storage_offset, counter, slot, event)
        key = (handle, storage_offset)
        held = self._current.get(key) or self._held.get(key)
        if held is not None and held.nbytes == nbytes and held.device == device:
            try:  # the event first: the sender may drop it once this share's counter is released
                if sync:
                    self._wait_on_event(device, event)  # the sender's writes before this share
                tensor = held.view(dtype, size, stride, offset)
            finally:
                self.counters.release(counter, slot)  # this share's: the sender's block waits
            self.num_reused += 1
        else:
            storage = self._open(device, handle, nbytes, storage_offset, counter, slot, event, sync)
            held = _Held(storage, nbytes, device)
            tensor = held.view(dtype, size, stride, offset)
            self.num_opened += 1
        self._current[key] = held
        if cls is torch.nn.Parameter:
            return torch.nn.Parameter(tensor, requires_grad=bool(requires_grad))
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def end_payload(self) -> None:
        """The payload was copied: its storages replace the held ones (those it did not reuse
        close now)."""
        self._held, self._current = self._current, {}

    def release(self) -> None:
        """Closes every held handle (each storage's deleter waits for its stream, then releases
        the counter it kept) and unmaps the counter files."""
        self._held, self._current = {}, {}
        self.counters.close()


def _check_args(
    cls: Any, dtype: Any, device: Any, handle: Any, nbytes: Any, storage_offset: Any,
    counter: Any, slot: Any, event: Any,
) -> None:  # fmt: skip
    if not (
        cls in (Tensor, torch.nn.Parameter)
        and isinstance(dtype, torch.dtype)
        and type(device) is int
        and type(handle) is bytes
        and type(nbytes) is int
        and nbytes > 0
        and type(storage_offset) is int
        and storage_offset >= 0
        and type(counter) is bytes
        and type(slot) is int
        and type(event) is bytes
    ):
        raise WeightTransferError(
            "a CUDA tensor in the payload has malformed rebuild arguments (expected torch's "
            "reduce_tensor: a tensor class, dtype, device index, handle bytes, sizes and "
            "offsets as ints, counter and event bytes); nothing was written"
        )
