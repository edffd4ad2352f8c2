"""A cached copy plan: where each byte of a flattened bucket lands in a model's parameters.

A trainer sends the same buckets every refit (the same names, dtypes, shapes and offsets), so
the work that depends only on that metadata is done once per bucket and kept: validating every
entry, and finding what each layer's ``weight_loader`` copies where. The loaders are traced, not
re-implemented (``loader_trace.py``): each runs once on a ``meta`` probe of the checkpoint tensor
under a dispatch mode that records its ``copy_`` calls (destination view, source view) instead of
running them. A refit of that bucket then only issues the recorded copies::

    step         recorded copy                                    launches per bucket
    ───────────  ───────────────────────────────────────────────  ──────────────────────────────
    Run          source slice and destination both contiguous     one per run of tensors that
                 (same dtype: bytes; else cast on copy)           are adjacent in both the bucket
                                                                  and the parameters' storage
    StridedCopy  a strided source (a TP shard along dim 1)        one per copy
    LoaderCall   a loader that does more than ``copy_``           the loader itself, as
                                                                  ``load_weights`` would

The engine's parameters are views of one pool block laid out in module order (``adopt``), so a
bucket packed in the model's own order is one ``Run``. How a plan is built from the traces, and
its runs merged, is ``plan_builder.py``.

Invariants: a plan is only built from entries ``check_weights`` accepted (errors are raised at
build time, before any write, and such a plan is never cached); a plan is used only while its
model's weight table and every destination storage address are the ones it was built against,
and every destination sits where it sat in its storage (``is_valid_for``), else it is built
again. Lookups are cheap when nothing changed: ``bucket_items`` gives the same ``BucketLayout``
object for the same metadata, whose hash is computed once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from dormant.models import CausalLM
from dormant.models.weights import WeightTarget
from dormant.worker.cuda_streams import current_stream
from dormant.worker.transfer_errors import WeightTransferError


@dataclass(frozen=True)
class BucketItem:
    """One tensor of a bucket: ``nbytes`` bytes of ``dtype`` at byte ``start`` of the buffer."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start: int
    nbytes: int


class BucketLayout(tuple[BucketItem, ...]):
    """A bucket's items as one key: its hash is computed once, so a plan lookup with the layout
    ``bucket_items`` keeps for the bucket's metadata hashes no item (and compares by identity)."""

    _hash: int

    def __new__(cls, items: Iterable[BucketItem] = ()) -> BucketLayout:
        layout = super().__new__(cls, items)
        layout._hash = tuple.__hash__(layout)
        return layout

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or tuple.__eq__(self, other)


def source_view(flat_bytes: Tensor, start: int, nbytes: int, dtype: torch.dtype) -> Tensor:
    """Bytes ``[start, start + nbytes)`` of the uint8 buffer viewed as ``dtype`` (1-D); a slice
    that is not aligned to its dtype (SGLang packs with no padding) is copied out first. The whole
    buffer is not sliced (a bucket in the model's order is one run of all of it)."""
    whole = start == 0 and nbytes == flat_bytes.numel()
    part = flat_bytes if whole else flat_bytes[start : start + nbytes]
    if dtype == torch.uint8:
        return part
    if part.data_ptr() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype)


@dataclass(frozen=True)
class Run:
    src_start: int
    src_nbytes: int
    src_dtype: torch.dtype
    dst: Tensor  # 1-D: uint8 when no cast is needed, else the destination's dtype

    def run(self, flat_bytes: Tensor) -> None:
        dtype = torch.uint8 if self.dst.dtype == torch.uint8 else self.src_dtype
        self.dst.copy_(source_view(flat_bytes, self.src_start, self.src_nbytes, dtype))


@dataclass(frozen=True)
class StridedCopy:
    item: BucketItem
    offset: int  # elements, relative to the item's first element
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dst: Tensor

    def run(self, flat_bytes: Tensor) -> None:
        base = source_view(flat_bytes, self.item.start, self.item.nbytes, self.item.dtype)
        src = base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)
        self.dst.copy_(src)


@dataclass(frozen=True)
class LoaderCall:
    item: BucketItem
    target: WeightTarget

    def run(self, flat_bytes: Tensor) -> None:
        item, target = self.item, self.target
        tensor = source_view(flat_bytes, item.start, item.nbytes, item.dtype).view(item.shape)
        target.loader(target.tensor, tensor, target.shard_id)


Step = Run | StridedCopy | LoaderCall


@dataclass(frozen=True)
class CopyPlan:
    steps: tuple[Step, ...]
    names: frozenset[str]  # what a run writes (an alias: the names it covers)
    num_bytes: int  # the buffer must hold at least this many bytes
    table: dict[str, WeightTarget]
    targets: tuple[Tensor, ...]  # the parameters (and buffers) the plan writes
    addresses: tuple[int, ...]  # each target's data address
    offsets: tuple[int, ...]  # each target's offset in its storage (elements)
    devices: frozenset[torch.device]  # the targets'

    @property
    def num_copies(self) -> int:
        return len(self.steps)

    @cached_property
    def is_untracked(self) -> bool:
        """Only Runs: each writes through a tensor of its own over the storage (``set_``), which
        autograd does not track, so the plan runs outside no_grad; a strided copy or a loader
        writes a view of a parameter, under no_grad."""
        return all(isinstance(step, Run) for step in self.steps)

    def is_valid_for(self, model: CausalLM) -> bool:
        """False once the model was re-materialised (a new table), or a target's memory moved:
        its storage (``param.data = ...``, a re-adoption) or its place in it (two parameters'
        ``data`` swapped within one pool block). A target's storage address is its data
        address less its offset, so equal data addresses and offsets are equal storage
        addresses too. The model has no hook for ``param.data = ...``, so every target is read:
        two C calls each, no Python per target."""
        targets = self.targets
        return (
            model.weight_table() is self.table
            and tuple(map(Tensor.data_ptr, targets)) == self.addresses
            and tuple(map(Tensor.storage_offset, targets)) == self.offsets
        )

    def run(self, model: CausalLM, flat_bytes: Tensor) -> set[str]:
        """Issues every copy and waits for them; tells ``model.weight_observer`` as
        ``load_weights`` does. Raises ``WeightTransferError`` when a copy fails (the observer was
        told: every weight is stale), or the observer's refusal before anything is written."""
        if flat_bytes.numel() < self.num_bytes:
            raise WeightTransferError(
                f"the bucket holds {flat_bytes.numel()} bytes but its metadata needs "
                f"{self.num_bytes}; nothing was written"
            )
        observer = model.weight_observer
        if observer is not None:
            observer.before_write()  # a refusal writes nothing and marks nothing stale
        try:
            if self.is_untracked:
                for step in self.steps:
                    step.run(flat_bytes)
            else:
                with torch.no_grad():
                    for step in self.steps:
                        step.run(flat_bytes)
            wait_for_copies({flat_bytes.device, *self.devices})
        except BaseException as error:
            if observer is not None:
                observer.failed()
            raise WeightTransferError(
                f"copying the received weights failed ({type(error).__name__}: {error}); some "
                "weights may be written, so every weight is marked stale: refit all of them"
            ) from error
        if observer is not None:
            observer.written(self.names)
        return set(self.names)


def wait_for_copies(devices: set[torch.device]) -> None:
    """Returns once this thread's work on each CUDA device's current stream finished, so that a
    sender may free or reuse the tensors it sent."""
    for device in devices:
        if device.type == "cuda":
            current_stream(device).synchronize()
