"""IPC payloads: the classes a trainer pickles (SGLang's names), and restricted unpickling.

An entry is rebuilt by an unpickler that resolves only tensor-handle rebuilders, torch dtypes and
bucket metadata; any other global is refused (a payload from another process must not run code).
CUDA tensors are rebuilt by a function the caller chooses (``ipc_receiver.IpcHandles`` keeps
their handles open between buckets); SGLang's patched reductions, which send a device UUID
instead of an index, are mapped to this process's index first.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.multiprocessing  # registers the tensor reductions with ForkingPickler
from torch import Tensor
from torch.multiprocessing import reductions

from dormant.worker.transfer_errors import WeightTransferError

SerializedEntry = str | bytes


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket (SGLang's field names; pickled across processes)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    """A tensor serialized once per TP rank: ``values[r]`` is rank r's serialized tensor."""

    values: list[SerializedEntry]

    def get(self, tp_rank: int) -> Tensor:
        rebuilt = deserialize_payload(rank_entry(self.values, tp_rank))
        if not isinstance(rebuilt, Tensor):
            raise WeightTransferError(f"a LocalSerializedTensor value holds {type(rebuilt)}")
        return rebuilt


def deserialize_payload(
    data: SerializedEntry, rebuild_cuda_tensor: Callable[..., Tensor] | None = None
) -> Any:
    """Rebuilds a serialized entry (base64 text or raw bytes) with the restricted unpickler;
    CUDA tensors through ``rebuild_cuda_tensor`` (default: torch's own).

    Raises ``WeightTransferError`` for corrupted data, a refused global, or a stale handle
    (its sender exited or freed the tensor).
    """
    return unpickle_entry(decode_entry(data), rebuild_cuda_tensor)[0]


def decode_entry(data: SerializedEntry) -> bytes:
    """The pickle bytes of an entry (base64 text or raw bytes); ``WeightTransferError`` for
    text that is not base64."""
    try:
        return base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    except Exception as error:
        raise _rebuild_error(error) from error  # not base64, or not bytes


def unpickle_entry(
    raw: bytes, rebuild_cuda_tensor: Callable[..., Tensor] | None = None
) -> tuple[Any, dict[int, Any]]:
    """``deserialize_payload`` of pickle bytes, and the unpickler's memo at the end (index ->
    object). Raises as ``deserialize_payload``."""
    rebuild = rebuild_cuda_tensor or reductions.rebuild_cuda_tensor
    try:
        unpickler = _PayloadUnpickler(io.BytesIO(raw), rebuild)
        return unpickler.load(), unpickler.memo.copy()
    except WeightTransferError:
        raise  # a typed error of the rebuild itself (malformed arguments, no such device)
    except Exception as error:
        raise _rebuild_error(error) from error


def _rebuild_error(error: Exception) -> WeightTransferError:
    return WeightTransferError(
        f"could not rebuild the tensors sent ({type(error).__name__}: {error}). A handle is "
        "stale once its sender exits or frees the tensor: the sender must keep its tensors "
        "alive until the update returns. Nothing was written."
    )


def rank_entry(entries: SerializedEntry | Sequence[SerializedEntry], tp_rank: int) -> Any:
    """Rank ``tp_rank``'s entry of a request (a single entry serves every rank)."""
    if isinstance(entries, str | bytes | bytearray):
        return entries
    if len(entries) == 1:
        return entries[0]
    if not 0 <= tp_rank < len(entries):
        raise WeightTransferError(
            f"the request has {len(entries)} entries (one per TP rank) but this is rank {tp_rank}"
        )
    return entries[tp_rank]


def _rebuild_on_device_index(rebuild: Callable[..., Tensor], *args: Any) -> Tensor:
    return rebuild(*args[:6], _device_index_of(args[6]), *args[7:])


def _device_index_of(device: Any) -> Any:
    """A device UUID (SGLang's patched reductions send one: indices differ between processes)
    as this process's device index; anything else as it is."""
    if not isinstance(device, str):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise WeightTransferError(f"no visible CUDA device has UUID {device}")


_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED_GLOBALS = frozenset(
    {(_REDUCTIONS, name) for name in (
        "rebuild_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
        "rebuild_storage_fd", "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_event",
    )}
    | {(m, n) for m in ("torch", "torch.storage") for n in ("UntypedStorage", "TypedStorage")}
    | {("torch", "Tensor"), ("torch", "Size"), ("torch.nn.parameter", "Parameter")}
    | {("torch.cuda", "Event"), ("multiprocessing.resource_sharer", "DupFd")}
)  # fmt: skip
# Classes of SGLang (or of slime's copies of them), whatever module sent them.
_RENAMED_CLASSES = {
    "FlattenedTensorMetadata": FlattenedTensorMetadata,
    "LocalSerializedTensor": LocalSerializedTensor,
}
# What an allowed global resolved to, so that each payload skips the import machinery.
_RESOLVED: dict[tuple[str, str], Any] = {}
_CUDA_REBUILDERS = {(_REDUCTIONS, "rebuild_cuda_tensor"), (None, "_rebuild_cuda_tensor_modified")}


class _PayloadUnpickler(pickle.Unpickler):
    """Resolves only tensor-handle rebuilders, torch dtypes and bucket metadata; CUDA tensors
    are rebuilt by ``rebuild_cuda_tensor`` (SGLang's device UUIDs mapped to indices first)."""

    def __init__(self, file: io.BytesIO, rebuild_cuda_tensor: Callable[..., Tensor]) -> None:
        super().__init__(file)
        # Not a bound method: the memo keeps what find_class returned, and a cycle through this
        # unpickler would keep the rebuilt tensors (their IPC handles open) until a collection.
        self._rebuild_cuda = partial(_rebuild_on_device_index, rebuild_cuda_tensor)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CUDA_REBUILDERS or (None, name) in _CUDA_REBUILDERS:
            return self._rebuild_cuda
        if name in _RENAMED_CLASSES:
            return _RENAMED_CLASSES[name]
        resolved = _RESOLVED.get((module, name))
        if resolved is not None:
            return resolved
        if (module, name) in _ALLOWED_GLOBALS:
            resolved = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            resolved = getattr(torch, name)
        if resolved is not None:
            _RESOLVED[(module, name)] = resolved  # torch's classes, rebuilders and dtypes
            return resolved
        raise pickle.UnpicklingError(
            f"refused to load {module}.{name}: a weight update carries only tensor handles "
            "and bucket metadata"
        )
