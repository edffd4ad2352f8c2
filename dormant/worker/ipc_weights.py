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

This module holds the formats, the sender's side and the bucket's layout; ``ipc_payload.py``
rebuilds an entry, and ``ipc_receiver.py`` writes what was rebuilt through a cached copy plan
(``copy_plan.py``). Receiving holds no copy of the weights: the rebuilt tensors view the
sender's memory and are copied into the parameters in place (device to device on a GPU; floats
are cast on copy). The sender keeps its tensors alive until the call returns; it returns only
after the copies finished. Unpickling is restricted to tensor handles and bucket metadata.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from operator import attrgetter
from typing import Any

import torch
import torch.multiprocessing  # registers the tensor reductions with ForkingPickler
from torch import Tensor

from dormant.models import CausalLM, WeightError
from dormant.worker.copy_plan import BucketItem, BucketLayout, source_view, wait_for_copies
from dormant.worker.ipc_payload import FlattenedTensorMetadata, SerializedEntry
from dormant.worker.transfer_errors import WeightTransferError

DEFAULT_BUCKET_BYTES = 512 << 20
FLATTENED_BUCKET = "flattened_bucket"
LOAD_FORMATS = (None, FLATTENED_BUCKET)
BUCKET_ALIGNMENT = 16  # bytes
NamedTensors = list[tuple[str, Tensor]]


# ── the sender's side (the trainer) ────────────────────────────────────────────────────────


def make_flattened_bucket(named_tensors: Sequence[tuple[str, Tensor]]) -> tuple[Tensor, list]:
    """Packs tensors (any dtypes) into one new contiguous uint8 buffer on their device; returns
    the buffer and one ``FlattenedTensorMetadata`` per tensor, with byte offsets. Each tensor
    starts on a ``BUCKET_ALIGNMENT``-byte boundary, so every slice can be viewed as its dtype."""
    if not named_tensors:
        raise ValueError("a flattened bucket needs at least one tensor")
    *_, last = _bucket_layout(named_tensors)
    flat = torch.zeros(last.end_idx, dtype=torch.uint8, device=named_tensors[0][1].device)
    payload = pack_flattened_bucket(flat, named_tensors)
    return flat, payload["metadata"]


def pack_flattened_bucket(buffer: Tensor, named_tensors: Sequence[tuple[str, Tensor]]) -> dict:
    """Packs tensors into the front of a reusable 1-D uint8 ``buffer`` (verl's way: the engine
    then keeps its handle open between buckets); returns the ``flattened_bucket`` payload, a
    view of ``buffer`` and the metadata. Pack the next bucket only after the engine returned."""
    metadata = _bucket_layout(named_tensors)
    if metadata and metadata[-1].end_idx > buffer.numel():
        raise ValueError(f"the bucket needs {metadata[-1].end_idx} bytes; the buffer has fewer")
    for (_, tensor), meta in zip(named_tensors, metadata, strict=True):
        part = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[meta.start_idx : meta.end_idx].copy_(part)
    end = metadata[-1].end_idx if metadata else 0
    return {"flattened_tensor": buffer[:end], "metadata": metadata}


def _bucket_layout(named_tensors: Sequence[tuple[str, Tensor]]) -> list[FlattenedTensorMetadata]:
    metadata, offset = [], 0
    for name, tensor in named_tensors:
        offset += -offset % BUCKET_ALIGNMENT
        nbytes = tensor.numel() * tensor.element_size()
        meta = FlattenedTensorMetadata(
            name, tensor.shape, tensor.dtype, offset, offset + nbytes, nbytes
        )
        metadata.append(meta)
        offset += nbytes
    return metadata


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


# ── the engine's side: rebuilding (ipc_receiver.py writes what was rebuilt) ─────────────────


def apply_named_tensors(model: CausalLM, named: NamedTensors) -> set[str]:
    """Validates every entry, then copies all of them with one ``model.load_weights`` call, and
    waits for the copies so that the sender may free or reuse its tensors."""
    model.check_weights([(name, tensor.shape, tensor.dtype) for name, tensor in named])
    try:
        written = model.load_weights(named)
        devices = {t.device for _, t in named} | {p.device for p in model.parameters()}
        wait_for_copies(devices)
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


def bucket_items(payload: Any) -> tuple[Tensor, BucketLayout]:
    """The buffer of a flattened bucket as uint8 bytes, and its tensors' byte ranges. Raises
    ``WeightTransferError`` when the metadata does not fit the buffer (nothing was written).

    A uint8 buffer has byte offsets and each slice is viewed as its dtype; any other buffer
    dtype has element offsets and every slice is of that dtype (SGLang's older bucket).

    The layout depends only on the metadata's fields and the buffer's dtype, so the last
    ``MAX_LAYOUTS`` distinct ones are kept, keyed by those values (never by an object's
    identity): a trainer that sends the same buckets every refit gets the same ``BucketLayout``
    object back (``CopyPlans`` then finds its plan without hashing an item). Only the check
    against the buffer's length depends on the buffer: it is made on every call."""
    if not isinstance(payload, Mapping) or not {"flattened_tensor", "metadata"} <= payload.keys():
        raise WeightTransferError(
            "a flattened_bucket entry must be a dict with 'flattened_tensor' and 'metadata', "
            f"got {type(payload).__name__}; nothing was written"
        )
    flat = payload["flattened_tensor"]
    if not isinstance(flat, Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise WeightTransferError(
            "'flattened_tensor' must be a contiguous 1-D tensor; nothing was written"
        )
    key = _layout_key(flat.dtype, payload["metadata"])
    try:
        kept = _LAYOUTS.get(key) if key is not None else None
    except TypeError:  # an unhashable field (a list for a shape): not kept
        key = kept = None
    if kept is not None and kept[1] <= flat.numel():
        return as_bytes(flat), kept[0]
    layout, end = layout_of(flat, payload["metadata"])
    if key is not None:
        with _LAYOUTS_LOCK:  # ranks may be threads of one process
            while len(_LAYOUTS) >= MAX_LAYOUTS:
                del _LAYOUTS[next(iter(_LAYOUTS))]
            _LAYOUTS[key] = (layout, end)
    return as_bytes(flat), layout


MAX_LAYOUTS = 4096  # distinct bucket layouts kept by ``bucket_items``; the oldest goes first
_LAYOUTS: dict[tuple[Any, ...], tuple[BucketLayout, int]] = {}  # key -> (layout, its end)
_LAYOUTS_LOCK = threading.Lock()
_METADATA_FIELDS = attrgetter("name", "shape", "dtype", "start_idx", "end_idx", "numel")


def _layout_key(flat_dtype: torch.dtype, metadata: Any) -> tuple[Any, ...] | None:
    """The values a bucket's layout is made of (equal values, equal layouts), or None for
    metadata that is not a list of ``FlattenedTensorMetadata`` (dicts: read, not kept)."""
    if type(metadata) is not list or not all(
        type(meta) is FlattenedTensorMetadata for meta in metadata
    ):
        return None
    return (flat_dtype, *map(_METADATA_FIELDS, metadata))


def as_bytes(flat: Tensor) -> Tensor:
    """A contiguous 1-D buffer as uint8 bytes (itself when it is bytes already, as SGLang's
    multi-dtype buckets are)."""
    return flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)


def layout_of(flat: Tensor, metadata: Any) -> tuple[BucketLayout, int]:
    """The bucket's items, validated against ``flat``, and the end of the last (elements)."""
    is_bytes, unit = flat.dtype == torch.uint8, flat.element_size()
    items, last = [], 0
    for meta in map(_as_metadata, metadata):
        start, end, shape = int(meta.start_idx), int(meta.end_idx), torch.Size(meta.shape)
        dtype = meta.dtype if is_bytes else flat.dtype
        expected = shape.numel() * (dtype.itemsize if is_bytes else 1)
        if not 0 <= start <= end <= flat.numel() or not end - start == meta.numel == expected:
            raise WeightTransferError(
                f"{meta.name}: bucket slice [{start}:{end}] (numel {meta.numel}) does not hold "
                f"{meta.dtype} {tuple(shape)} in a buffer of {flat.numel()} {flat.dtype}; "
                "nothing was written"
            )
        items.append(BucketItem(meta.name, shape, dtype, start * unit, (end - start) * unit))
        last = max(last, end)
    return BucketLayout(items), last


def unflatten_bucket(payload: Any) -> NamedTensors:
    """Views each tensor of a flattened bucket (no copy, unless a slice is not aligned to its
    dtype). Raises as ``bucket_items``. An empty bucket (no metadata) gives no tensors."""
    flat_bytes, items = bucket_items(payload)
    return [
        (i.name, source_view(flat_bytes, i.start, i.nbytes, i.dtype).view(i.shape)) for i in items
    ]


def _as_metadata(meta: Any) -> FlattenedTensorMetadata:
    if isinstance(meta, FlattenedTensorMetadata):
        return meta
    if isinstance(meta, Mapping):
        try:
            return FlattenedTensorMetadata(**meta)
        except TypeError as error:
            raise WeightTransferError(f"bad bucket metadata {dict(meta)}: {error}") from error
    raise WeightTransferError(f"bad bucket metadata of type {type(meta).__name__}")
