"""Weights from another process as IPC handles, in SGLang's ``update_weights_from_tensor`` formats.

The trainer shares its tensors with ``torch.multiprocessing.reductions.reduce_tensor`` (CUDA IPC
handles on a GPU; file descriptors or shared-memory names on the CPU), pickles them with
``ForkingPickler`` and, for transport as text, base64-encodes them (SGLang's
``MultiprocessingSerializer``, ``output_str=True``). Wire formats::

    request      one entry per TP rank (rank r reads entry r; a single entry serves every rank)
    entry        base64 str, or the raw pickle bytes
    load_format  the pickled object
    ───────────  ──────────────────────────────────────────────────────────────────────────────
    None         [(name, Tensor | LocalSerializedTensor), ...]   (full, unsharded HF tensors)
    "flattened_  {"flattened_tensor": Tensor (1-D), "metadata": [FlattenedTensorMetadata | dict]}
     bucket"     uint8 buffer: start/end are byte offsets, each slice is viewed as its dtype
                 (SGLang's multi-dtype bucket); any other dtype: element offsets (older bucket)

Receiving holds no copy of the weights: the rebuilt tensors view the sender's memory, and
``model.load_weights`` copies them into the parameters in place (device to device on a GPU;
floats are cast on copy). The sender keeps its tensors alive until the call returns; it returns
only after the copies finished. Unpickling is restricted to tensor handles and bucket metadata.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers the tensor reductions with ForkingPickler
from torch import Tensor
from torch.multiprocessing import reductions

from dormant.core.errors import UnsupportedOptionError
from dormant.models import CausalLM, WeightError
from dormant.worker.transfer_errors import WeightTransferError

DEFAULT_BUCKET_BYTES = 512 << 20
FLATTENED_BUCKET = "flattened_bucket"
LOAD_FORMATS = (None, FLATTENED_BUCKET)
BUCKET_ALIGNMENT = 16  # bytes
NamedTensors = list[tuple[str, Tensor]]
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
        rebuilt = deserialize_payload(_rank_entry(self.values, tp_rank))
        if not isinstance(rebuilt, Tensor):
            raise WeightTransferError(f"a LocalSerializedTensor value holds {type(rebuilt)}")
        return rebuilt


# ── the sender's side (the trainer) ────────────────────────────────────────────────────────


def make_flattened_bucket(named_tensors: Sequence[tuple[str, Tensor]]) -> tuple[Tensor, list]:
    """Packs tensors (any dtypes) into one contiguous uint8 buffer on their device; returns the
    buffer and one ``FlattenedTensorMetadata`` per tensor, with byte offsets. Each tensor starts
    on a ``BUCKET_ALIGNMENT``-byte boundary, so every slice can be viewed as its dtype."""
    if not named_tensors:
        raise ValueError("a flattened bucket needs at least one tensor")
    parts, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        part = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        padding = -offset % BUCKET_ALIGNMENT
        if padding:
            parts.append(part.new_zeros(padding))
            offset += padding
        parts.append(part)
        end = offset + part.numel()
        metadata.append(
            FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, end, part.numel())
        )
        offset = end
    return torch.cat(parts), metadata


def iter_buckets(
    named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[NamedTensors]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def serialize_for_update(obj: Any, *, output_str: bool = True) -> SerializedEntry:
    """``ForkingPickler`` bytes of ``obj`` (tensors become IPC handles), base64 text when
    ``output_str``. CPU handles can be opened once, and only while the sender lives."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    data = buffer.getvalue()
    return base64.b64encode(data).decode("ascii") if output_str else data


def flattened_bucket_request(
    named_tensors: Sequence[tuple[str, Tensor]], num_ranks: int = 1
) -> tuple[list[SerializedEntry], Tensor]:
    """A ``flattened_bucket`` request (one entry per TP rank) and the buffer, which the sender
    must keep alive until the engine returned."""
    flat, metadata = make_flattened_bucket(named_tensors)
    entries = [
        serialize_for_update({"flattened_tensor": flat, "metadata": metadata})
        for _ in range(num_ranks)
    ]
    return entries, flat


# ── the engine's side ──────────────────────────────────────────────────────────────────────


def update_weights_from_tensor(
    model: CausalLM,
    serialized_named_tensors: SerializedEntry | Sequence[SerializedEntry],
    *,
    load_format: str | None = None,
    tp_rank: int = 0,
) -> set[str]:
    """Rebuilds this rank's entry and writes it into ``model``; returns the names written.

    Raises ``UnsupportedOptionError`` for an unknown ``load_format``, ``WeightTransferError``
    when the entry cannot be rebuilt (nothing was written), ``WeightError`` when a name, shape
    or dtype does not fit (nothing was written), and ``WeightTransferError`` when a copy fails
    (the observer was told: every weight is stale).
    """
    if load_format not in LOAD_FORMATS:
        raise UnsupportedOptionError(
            f"load_format={load_format!r} is not supported for update_weights_from_tensor; "
            f"use one of {LOAD_FORMATS}"
        )
    payload = deserialize_payload(_rank_entry(serialized_named_tensors, tp_rank))
    if load_format == FLATTENED_BUCKET:
        named = unflatten_bucket(payload)
    else:
        named = [(name, _unwrap(value, tp_rank)) for name, value in _named_pairs(payload)]
    return apply_named_tensors(model, named)


def apply_named_tensors(model: CausalLM, named: NamedTensors) -> set[str]:
    """Validates every entry, then copies all of them with one ``model.load_weights`` call, and
    waits for the copies so that the sender may free or reuse its tensors."""
    model.check_weights([(name, tensor.shape, tensor.dtype) for name, tensor in named])
    try:
        written = model.load_weights(named)
        devices = {t.device for _, t in named} | {p.device for p in model.parameters()}
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except WeightError:
        raise
    except Exception as error:
        if model.weight_observer is not None:
            model.weight_observer.failed()  # a copy failing after load_weights returned
        raise WeightTransferError(
            f"copying the received weights failed ({type(error).__name__}: {error}); some "
            "weights may be written, so every weight is marked stale: refit all of them"
        ) from error
    return written


def deserialize_payload(data: SerializedEntry) -> Any:
    """Rebuilds a serialized entry (base64 text or raw bytes) with the restricted unpickler.

    Raises ``WeightTransferError`` for corrupted data, a refused global, or a stale handle
    (its sender exited or freed the tensor).
    """
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
        return _PayloadUnpickler(io.BytesIO(raw)).load()
    except Exception as error:
        raise WeightTransferError(
            f"could not rebuild the tensors sent ({type(error).__name__}: {error}). A handle is "
            "stale once its sender exits or frees the tensor: the sender must keep its tensors "
            "alive until the update returns. Nothing was written."
        ) from error


def unflatten_bucket(payload: Any) -> NamedTensors:
    """Views each tensor of a flattened bucket (no copy). Raises ``WeightTransferError`` when
    the metadata does not fit the buffer. An empty bucket (no metadata) gives no tensors."""
    if not isinstance(payload, Mapping) or not {"flattened_tensor", "metadata"} <= payload.keys():
        raise WeightTransferError(
            "a flattened_bucket entry must be a dict with 'flattened_tensor' and 'metadata', "
            f"got {type(payload).__name__}; nothing was written"
        )
    flat = payload["flattened_tensor"]
    if not isinstance(flat, Tensor) or flat.dim() != 1:
        raise WeightTransferError("'flattened_tensor' must be a 1-D tensor; nothing was written")
    metadata = [_as_metadata(meta) for meta in payload["metadata"]]
    return [(meta.name, _bucket_view(flat, meta)) for meta in metadata]


def _bucket_view(flat: Tensor, meta: FlattenedTensorMetadata) -> Tensor:
    start, end, shape, dtype = (
        int(meta.start_idx),
        int(meta.end_idx),
        torch.Size(meta.shape),
        meta.dtype,
    )
    is_bytes = flat.dtype == torch.uint8 and dtype != torch.uint8
    expected = shape.numel() * (dtype.itemsize if is_bytes else 1)
    if not 0 <= start <= end <= flat.numel() or end - start != expected or meta.numel != expected:
        raise WeightTransferError(
            f"{meta.name}: bucket slice [{start}:{end}] (numel {meta.numel}) does not hold "
            f"{dtype} {tuple(shape)} in a buffer of {flat.numel()} {flat.dtype}; "
            "nothing was written"
        )
    part = flat[start:end]
    if not is_bytes:
        return part.reshape(shape)
    if (flat.storage_offset() + start) % dtype.itemsize:  # SGLang packs with no padding:
        # copy out this one tensor
        part = part.clone()
    return part.view(dtype).reshape(shape)


def _as_metadata(meta: Any) -> FlattenedTensorMetadata:
    if isinstance(meta, FlattenedTensorMetadata):
        return meta
    if isinstance(meta, Mapping):
        try:
            return FlattenedTensorMetadata(**meta)
        except TypeError as error:
            raise WeightTransferError(f"bad bucket metadata {dict(meta)}: {error}") from error
    raise WeightTransferError(f"bad bucket metadata of type {type(meta).__name__}")


def _named_pairs(payload: Any) -> list[tuple[str, Any]]:
    if isinstance(payload, Mapping):
        payload = list(payload.items())
    if not isinstance(payload, list | tuple) or not all(
        isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)
        for item in payload
    ):
        raise WeightTransferError(
            "a named-tensors entry must be a list of (name, tensor) pairs; nothing was written"
        )
    return [(name, value) for name, value in payload]


def _unwrap(value: Any, tp_rank: int) -> Tensor:
    if isinstance(value, LocalSerializedTensor):
        return value.get(tp_rank)
    if not isinstance(value, Tensor):
        raise WeightTransferError(f"expected a tensor, got {type(value).__name__}")
    return value


def _rank_entry(entries: SerializedEntry | Sequence[SerializedEntry], tp_rank: int) -> Any:
    if isinstance(entries, str | bytes | bytearray):
        return entries
    if len(entries) == 1:
        return entries[0]
    if not 0 <= tp_rank < len(entries):
        raise WeightTransferError(
            f"the request has {len(entries)} entries (one per TP rank) but this is rank {tp_rank}"
        )
    return entries[tp_rank]


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> Tensor:
    """``rebuild_cuda_tensor`` whose device (argument 6) may be a device UUID, as SGLang's
    patched reductions send it (device indices differ between processes)."""
    device = args[6]
    if isinstance(device, str):
        matches = [
            i
            for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == device
        ]
        if not matches:
            raise WeightTransferError(f"no visible CUDA device has UUID {device}")
        args = (*args[:6], matches[0], *args[7:])
    return reductions.rebuild_cuda_tensor(*args)


_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED_GLOBALS = frozenset(
    {(_REDUCTIONS, name) for name in (
        "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
        "rebuild_typed_storage_child", "rebuild_storage_fd", "rebuild_storage_filename",
        "rebuild_storage_empty", "rebuild_event",
    )}
    | {(m, n) for m in ("torch", "torch.storage") for n in ("UntypedStorage", "TypedStorage")}
    | {("torch", "Tensor"), ("torch", "Size"), ("torch.nn.parameter", "Parameter")}
    | {("torch.cuda", "Event"), ("multiprocessing.resource_sharer", "DupFd")}
)  # fmt: skip
# Classes and functions of SGLang (or of slime's copies of them), whatever module sent them.
_RENAMED_GLOBALS = {
    "FlattenedTensorMetadata": FlattenedTensorMetadata,
    "LocalSerializedTensor": LocalSerializedTensor,
    "_rebuild_cuda_tensor_modified": _rebuild_cuda_tensor_by_uuid,
}


class _PayloadUnpickler(pickle.Unpickler):
    """Resolves only tensor-handle rebuilders, torch dtypes and bucket metadata."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _RENAMED_GLOBALS:
            return _RENAMED_GLOBALS[name]
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refused to load {module}.{name}: a weight update carries only tensor handles "
            "and bucket metadata"
        )
