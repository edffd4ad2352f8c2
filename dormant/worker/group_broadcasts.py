"""The broadcasts of one ``update_weights_from_distributed`` request, as this rank receives them.

A request's lists say what rank 0 broadcasts beside it, and so what this rank must receive to
stay in step with it::

    load_format         what rank 0 broadcasts           what this rank holds at once
    ──────────────────  ───────────────────────────────  ────────────────────────────────────
    None                each tensor, in the listed order  one bucket of receive buffers
                                                          (≤ bucket_bytes, or one larger tensor)
    "flattened_bucket"  one uint8 buffer: the tensors'    that buffer (the trainer sizes it)
                        bytes back to back, in order
    "packed"            vLLM's packed chunks: uint8       one chunk (≤ packed_bytes plus the
                        buffers as ``packed_chunks`` cuts  tensor that passed it)
                        them at ``packed_bytes``

Receiving needs only the count, dtypes and shapes, and the format: ``BroadcastRequest.parse``
raises ``UpdateGroupError`` where they do not say what arrives (lists of different lengths, an
unknown dtype, a bad shape, an unknown format). Names matter only once the tensors are written
(``check_names``). ``Broadcasts`` receives them in order; where a broadcast fails, times out or
cannot be received (its buffers not allocated), it raises ``BroadcastLost``, and the group is
then out of step with the trainer for good.
"""

from __future__ import annotations

import math
import operator
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from dormant.worker.ipc_weights import FLATTENED_BUCKET
from dormant.worker.transfer_errors import UpdateGroupError

DTypeLike = torch.dtype | str
PACKED = "packed"  # vLLM's weight-transfer format (``vllm_weight_transfer.py``)
T = TypeVar("T")


def packed_chunks(
    items: Iterable[T], nbytes: Callable[[T], int], buffer_bytes: int
) -> Iterator[list[T]]:
    """vLLM's packing rule (its ``pack_tensors``): items in order, a chunk closed by the item
    that takes its bytes past ``buffer_bytes``, so one larger item is never split."""
    chunk: list[T] = []
    total = 0
    for item in items:
        chunk.append(item)
        total += nbytes(item)
        if total > buffer_bytes:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BroadcastRequest:
    """What one request says arrives: ``specs`` in order, as ``load_format`` sends them."""

    specs: tuple[TensorSpec, ...]
    load_format: str | None
    packed_bytes: int | None = None  # the chunk size of the "packed" format

    @classmethod
    def parse(
        cls,
        names: Sequence[str],
        dtypes: Sequence[DTypeLike],
        shapes: Sequence[Sequence[int]],
        load_format: str | None,
        packed_bytes: int | None = None,
    ) -> BroadcastRequest:
        """Raises ``UpdateGroupError`` where the lists or the format do not say what arrives."""
        if load_format not in (None, FLATTENED_BUCKET, PACKED):
            raise UpdateGroupError(f"load_format={load_format!r}: use None or {FLATTENED_BUCKET!r}")
        is_size = isinstance(packed_bytes, int) and not isinstance(packed_bytes, bool)
        if load_format == PACKED and not (is_size and packed_bytes > 0):  # type: ignore[operator]
            raise UpdateGroupError(f"packed_bytes={packed_bytes!r}: a packed chunk size > 0")
        if not len(names) == len(dtypes) == len(shapes):
            raise UpdateGroupError(
                f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                f"{len(shapes)})"
            )
        specs = tuple(
            TensorSpec(name, _dtype(i, dtype), _shape(i, shape))
            for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True))
        )
        return cls(specs, load_format, packed_bytes if load_format == PACKED else None)

    def check_names(self) -> None:
        """Raises ``UpdateGroupError`` for a name that is not a string."""
        bad = [f"names[{i}] = {s.name!r}" for i, s in enumerate(self.specs) if not _is_str(s)]
        if bad:
            raise UpdateGroupError(f"every name must be a string: {', '.join(bad[:3])}")

    def metas(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(s.name, s.shape, s.dtype) for s in self.specs]

    def buckets(self, bucket_bytes: int) -> Iterator[list[TensorSpec]]:
        """The specs in runs received together: all of them for a flattened bucket, vLLM's
        chunks when packed, else runs of at most ``bucket_bytes`` (or one larger tensor)."""
        if self.load_format == FLATTENED_BUCKET:
            yield list(self.specs)
            return
        if self.packed_bytes is not None:
            yield from packed_chunks(self.specs, _nbytes, self.packed_bytes)
            return
        bucket: list[TensorSpec] = []
        size = 0
        for spec in self.specs:
            if bucket and size + spec.nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(spec)
            size += spec.nbytes
        if bucket:
            yield bucket


class BroadcastLost(Exception):
    """A broadcast of the request failed, timed out or could not be received: the group is out
    of step with the trainer."""

    def __init__(self, num_received: int, num_tensors: int, cause: BaseException) -> None:
        self.num_received, self.num_tensors, self.cause = num_received, num_tensors, cause
        super().__init__(
            f"the broadcast failed after {num_received} of {num_tensors} tensors arrived "
            f"({type(cause).__name__}: {cause})"
        )


class Broadcasts:
    """The tensors of one request, ``(name, tensor)`` in order as they arrive; iterate once.
    ``lost`` is the ``BroadcastLost`` raised, once one was."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        request: BroadcastRequest,
        *,
        device: torch.device,
        bucket_bytes: int,
        timeout_s: float,
    ) -> None:
        self.group: dist.ProcessGroup | None = group
        self.request, self.device = request, device
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.num_received = 0
        self.lost: BroadcastLost | None = None
        self._items = self._receive()

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return self._items

    def drop_rest(self) -> None:
        """Receives, and drops, every tensor not received yet (all of a refused request's), so
        that the group stays in step with the trainer. Raises ``BroadcastLost``."""
        for _ in self._items:
            pass

    def release(self) -> None:
        """Drops the group. A destroyed gloo group closes its connections, and so fails the
        trainer's broadcast over it, only once nothing references it (its abort does not)."""
        self.group = None

    def _receive(self) -> Iterator[tuple[str, Tensor]]:
        is_flat = self.request.load_format in (FLATTENED_BUCKET, PACKED)
        for bucket in self.request.buckets(self.bucket_bytes):
            try:
                received = self._allocate(bucket, is_flat)
                self._broadcast_into(received)
            except Exception as error:
                # Its frames hold the works, which hold the group's connections open.
                traceback.clear_frames(error.__traceback__)
                num_tensors = len(self.request.specs)
                self.lost = BroadcastLost(self.num_received, num_tensors, error)
                raise self.lost from error
            self.num_received += len(bucket)
            buffers = _views(received[0], bucket) if is_flat else received
            yield from zip((s.name for s in bucket), buffers, strict=True)
            del buffers, received

    def _broadcast_into(self, buffers: list[Tensor]) -> None:
        """Receives rank 0's broadcasts into ``buffers``, launched together (pipelined)."""
        assert self.group is not None, "the group was released"
        works = [self.group.broadcast([buffer], from_rank0()) for buffer in buffers]
        for work in works:
            wait_for(work, self.timeout_s)

    def _allocate(self, bucket: list[TensorSpec], is_flat: bool) -> list[Tensor]:
        if is_flat:
            num_bytes = sum(s.nbytes for s in bucket)
            return [torch.empty(num_bytes, dtype=torch.uint8, device=self.device)]
        return [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in bucket]


def _dtype(index: int, dtype: DTypeLike) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise UpdateGroupError(f"dtypes[{index}] = {dtype!r} is no dtype (e.g. 'bfloat16')")
    return found


def _shape(index: int, shape: Sequence[int]) -> torch.Size:
    try:
        if isinstance(shape, str | bytes) or any(isinstance(d, bool) for d in shape):
            raise TypeError("not a list of ints")
        size: torch.Size | None = torch.Size([operator.index(d) for d in shape])
    except TypeError:
        size = None
    if size is None or any(d < 0 for d in size):
        raise UpdateGroupError(
            f"shapes[{index}] = {shape!r} is no shape (expected a list of non-negative ints)"
        )
    return size


def _nbytes(spec: TensorSpec) -> int:
    return spec.nbytes


def _is_str(spec: TensorSpec) -> bool:
    return isinstance(spec.name, str)


def _views(flat: Tensor, specs: list[TensorSpec]) -> list[Tensor]:
    """Each tensor's bytes as its dtype (a slice not aligned to its dtype is copied out after
    the broadcast filled it: one tensor's bytes)."""
    views, offset = [], 0
    for spec in specs:
        part = flat[offset : offset + spec.nbytes]
        part = part.clone() if offset % spec.dtype.itemsize else part
        views.append(part.view(spec.dtype).reshape(spec.shape))
        offset += spec.nbytes
    return views


def from_rank0() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def wait_for(work: dist.Work, timeout_s: float) -> None:
    if not work.wait(timedelta(seconds=timeout_s)):
        raise TimeoutError(f"timed out after {timeout_s} s")
