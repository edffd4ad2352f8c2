"""Flattened buckets read before, found by their bytes: the metadata is unpickled once per layout.

A trainer's bucket is the same pickle every refit but for the tensor's rebuild arguments (the
handle, the ref-counter slot, the event: new for every share), so everything outside those
arguments, the metadata included, is the same bytes. ``PayloadSkeletons.read`` keys a bucket by
those bytes (the pickle less its FRAME header and less the argument tuple of its one
``rebuild_cuda_tensor``) and, on a hit, unpickles only the head (the dict's first key and the
tensor: its rebuild runs, so the handle, counter and event are dealt with as always), then
returns the layout kept for that key: the metadata is neither unpickled nor read again. The head
is unpickled as one FRAME: unframed, the C unpickler reads it from its file an opcode at a time,
through Python ``read`` calls (16 us against 7 for this ~300-byte head on the CI CPU).

Why equal bytes mean an equal layout: the rest of the pickle is the same opcodes, so it builds the
same objects, except where it refers to the memo of the argument tuple (``BINGET``: e.g. the
buffer's dtype when an item has it too). The first read of a key finds those references
(``pickletools.genops``) and keeps the objects they resolved to and the memo's length; a hit is
used only when the head's memo has the same length and the same objects there, else the bucket is
read in full (its tensor, already rebuilt, is not rebuilt twice). Only a payload that rebuilt one
tensor and is a ``flattened_bucket`` of ``FlattenedTensorMetadata`` is kept; the layout is still
checked against every buffer's length and dtype.
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dormant.worker.copy_plan import BucketLayout
from dormant.worker.ipc_payload import (
    FlattenedTensorMetadata,
    SerializedEntry,
    decode_entry,
    unpickle_entry,
)
from dormant.worker.ipc_weights import as_bytes, bucket_items, layout_of
from dormant.worker.transfer_errors import WeightTransferError

MAX_SKELETONS = 1024  # bucket keys kept per receiver; the oldest goes first
# The tensor's rebuild global (torch's, SGLang's patched one) as protocol 4+ pickles it (its
# name, MEMOIZE, STACK_GLOBAL, MEMOIZE), then the MARK of its arguments; their end: TUPLE,
# MEMOIZE, REDUCE, MEMOIZE.
_GLOBALS = tuple(
    b"\x8c" + bytes([len(name)]) + name + b"\x94\x93\x94("
    for name in (b"rebuild_cuda_tensor", b"_rebuild_cuda_tensor_modified")
)
_ARGS_END = b"t\x94R\x94"
_FRAME = 0x95
_SCALARS = (str, bytes, int)
_GETS = ("GET", "BINGET", "LONG_BINGET")


@dataclass
class _Skeleton:
    metadata: list[FlattenedTensorMetadata]
    memo_len: int  # the memo's length where the arguments end
    refs: tuple[tuple[int, Any], ...]  # (index, object) of the argument memo the rest reads
    layouts: dict[torch.dtype, tuple[BucketLayout, int]] = field(default_factory=dict)

    def matches(self, memo: dict[int, Any]) -> bool:
        return len(memo) == self.memo_len and all(
            _same(memo.get(index), value) for index, value in self.refs
        )

    def items(self, flat: Any) -> tuple[Tensor, BucketLayout]:
        if not isinstance(flat, Tensor) or flat.dim() != 1 or not flat.is_contiguous():
            return bucket_items({"flattened_tensor": flat, "metadata": self.metadata})  # raises
        kept = self.layouts.get(flat.dtype)
        if kept is None or kept[1] > flat.numel():
            kept = self.layouts[flat.dtype] = layout_of(flat, self.metadata)  # raises
        return as_bytes(flat), kept[0]


class PayloadSkeletons:
    """One receiver's flattened buckets by key (see above); ``num_hits`` / ``num_misses``
    count the reads that used a kept layout / read the bucket in full."""

    def __init__(self) -> None:
        self._kept: dict[tuple[bytes, bytes], _Skeleton] = {}
        self.num_hits = self.num_misses = 0

    def read(
        self, entry: SerializedEntry, rebuild: Callable[..., Tensor]
    ) -> tuple[Tensor, BucketLayout]:
        """``bucket_items(deserialize_payload(entry, rebuild))``: the buffer as uint8 bytes and
        its layout. Raises as those do (``WeightTransferError``; nothing was written)."""
        raw = decode_entry(entry)
        split = _split(raw)
        key = (raw[split[0] : split[1]], raw[split[2] :]) if split is not None else None
        skeleton = self._kept.get(key) if key is not None else None
        first = None
        if skeleton is not None and split is not None:
            calls = _Counting(rebuild)
            flat, memo = unpickle_entry(_framed(raw[:2], raw[split[0] : split[2]] + b"."), calls)
            if calls.count != 1:
                raise WeightTransferError(
                    "a flattened bucket's tensor carries another tensor in its rebuild "
                    "arguments; nothing was written"
                )
            if skeleton.matches(memo):
                bucket = skeleton.items(flat)
                self.num_hits += 1
                return bucket
            first = flat  # read in full below, without rebuilding it again
        self.num_misses += 1
        calls = _Counting(rebuild, first)
        payload, memo = unpickle_entry(raw, calls)
        flat_bytes, layout = bucket_items(payload)
        if key is not None and split is not None and calls.count == 1:
            kept = _skeleton_of(payload, memo, raw, split[2])
            if kept is not None:
                flat = payload["flattened_tensor"]
                kept.layouts[flat.dtype] = (layout, _end(layout) // flat.element_size())
                self._keep(key, kept)
        return flat_bytes, layout

    def _keep(self, key: tuple[bytes, bytes], skeleton: _Skeleton) -> None:
        self._kept.pop(key, None)
        while len(self._kept) >= MAX_SKELETONS:
            del self._kept[next(iter(self._kept))]
        self._kept[key] = skeleton

    def clear(self) -> None:
        self._kept.clear()


class _Counting:
    """The rebuild, counted; its first call returns ``first`` when one is given (that tensor
    was rebuilt already, from the same arguments)."""

    def __init__(self, rebuild: Callable[..., Tensor], first: Tensor | None = None) -> None:
        self.rebuild, self.first, self.count = rebuild, first, 0

    def __call__(self, *args: Any) -> Tensor:
        self.count += 1
        if self.count == 1 and self.first is not None:
            return self.first
        return self.rebuild(*args)


def _split(raw: bytes) -> tuple[int, int, int] | None:
    """(body, args, end): where the pickle's opcodes start past PROTO (and a FRAME header),
    where the rebuild's argument tuple starts, and where it ends (past REDUCE and MEMOIZE);
    None for a pickle that is not protocol 4+, has no such rebuild, or whose head (to ``end``)
    runs past its first frame: a hit re-frames the head as one, which a FRAME header inside it
    would corrupt (a pickler frames every 64 KiB: the metadata pickled before the tensor)."""
    if len(raw) < 11 or raw[0] != 0x80 or raw[1] < 4:
        return None
    framed = raw[2] == _FRAME
    body = 11 if framed else 2
    for pattern in _GLOBALS:
        start = raw.find(pattern, body)
        if start >= 0:
            args = start + len(pattern)
            end = raw.find(_ARGS_END, args)
            if end < 0:
                return None
            end += len(_ARGS_END)
            if framed and end > body + int.from_bytes(raw[3:11], "little"):
                return None
            return body, args, end
    return None


def _framed(proto: bytes, body: bytes) -> bytes:
    """A pickle of ``body``'s opcodes (``STOP`` included) after ``proto``, in one FRAME."""
    return proto + bytes([_FRAME]) + len(body).to_bytes(8, "little") + body


def _skeleton_of(payload: Any, memo: dict[int, Any], raw: bytes, end: int) -> _Skeleton | None:
    """What a hit needs of a payload read in full, or None when it cannot be kept."""
    metadata = payload.get("metadata") if isinstance(payload, dict) else None
    if (
        not isinstance(payload, dict)
        or set(payload) != {"flattened_tensor", "metadata"}
        or type(metadata) is not list
        or not all(type(meta) is FlattenedTensorMetadata for meta in metadata)
    ):
        return None
    memo_len, refs = 0, set[int]()
    for opcode, arg, position in pickletools.genops(raw):
        if position is not None and position < end:
            memo_len += opcode.name == "MEMOIZE"
        elif opcode.name in _GETS and isinstance(arg, int) and arg < memo_len:
            refs.add(arg)  # the argument tuple's memo (or before it), read by the rest
        if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            return None  # explicit memo indices: not what a protocol 4+ pickler writes
    values = tuple((index, memo.get(index)) for index in sorted(refs))
    if not all(_is_comparable(value) for _, value in values):
        return None
    return _Skeleton(metadata, memo_len, values)


def _is_comparable(value: Any) -> bool:
    return type(value) in _SCALARS or isinstance(value, type | torch.dtype)


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and type(a) in _SCALARS and a == b)


def _end(layout: BucketLayout) -> int:
    """Its last byte's end in the buffer (bytes)."""
    return max((item.start + item.nbytes for item in layout), default=0)
