"""How a copy plan (``copy_plan.py``) is built: validate the bucket's entries, trace each one's
loader, merge the copies that are adjacent in both the bucket and the parameters' storage.

Merging keeps the bucket's order: consecutive runs merge only in bucket order, so overlapping
writes (an alias beside its names) keep ``load_weights``'s order. A merged run is one copy,
however long: cutting it into pieces, so that the device could start on the first while the host
enqueues the rest, did not finish sooner on an H100 (``benchmarks/copy_enqueue.py``: enqueueing a
2 GiB copy takes ~30 us of host time, and 16 pieces of 512 MiB end 11 % later than one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dormant.models import CausalLM
from dormant.models.weights import is_ignored
from dormant.worker.copy_plan import BucketItem, CopyPlan, LoaderCall, Run, Step, StridedCopy
from dormant.worker.loader_trace import traced_copies


def build_plan(model: CausalLM, items: Sequence[BucketItem]) -> CopyPlan:
    """Validates ``items`` (``WeightError`` naming every bad entry; nothing is written), then
    traces each one's loader and merges adjacent runs."""
    model.check_weights([(item.name, item.shape, item.dtype) for item in items])
    table, is_tied = model.weight_table(), model.config.tie_word_embeddings
    spans: list[_Span | StridedCopy | LoaderCall] = []
    names: set[str] = set()
    targets: dict[int, Tensor] = {}
    storages: dict[int, Tensor] = {}  # storage address -> uint8 tensor over the whole storage
    for item in items:
        target = table.get(item.name)
        if target is None or is_ignored(item.name, is_tied):
            continue  # a name check_weights accepts and load_weights skips (MiMo's MTP layers)
        targets[id(target.tensor)] = target.tensor
        names.update(target.covers or (item.name,))
        copies = traced_copies(target, item.shape, item.dtype)
        if copies is None:
            spans.append(LoaderCall(item, target))
            continue
        spans.extend(_step_of(item, dst, src, storages) for dst, src in copies if dst.numel())
    tensors = tuple(targets.values())
    addresses = tuple(t.data_ptr() for t in tensors)
    offsets = tuple(int(t.storage_offset()) for t in tensors)
    num_bytes = max((item.start + item.nbytes for item in items), default=0)
    devices = frozenset(t.device for t in tensors)
    steps = _merged(spans)
    return CopyPlan(steps, frozenset(names), num_bytes, table, tensors, addresses, offsets, devices)


# ── merging ────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class _Span:
    """A contiguous copy before merging: source bytes and destination bytes in one storage."""

    src_start: int
    src_dtype: torch.dtype
    storage: Tensor  # uint8 over the destination's whole storage
    dst_start: int
    dst_dtype: torch.dtype
    numel: int

    def follows(self, other: _Span) -> bool:
        return (
            self.src_dtype == other.src_dtype
            and self.dst_dtype == other.dst_dtype
            and self.storage is other.storage
            and self.src_start == other.src_start + other.numel * other.src_dtype.itemsize
            and self.dst_start == other.dst_start + other.numel * other.dst_dtype.itemsize
        )

    def run_step(self) -> Run:
        nbytes = self.numel * self.dst_dtype.itemsize
        dst = self.storage[self.dst_start : self.dst_start + nbytes]
        if self.src_dtype != self.dst_dtype:
            dst = dst.view(self.dst_dtype)
        return Run(self.src_start, self.numel * self.src_dtype.itemsize, self.src_dtype, dst)


def _step_of(
    item: BucketItem, dst: Tensor, src: Tensor, storages: dict[int, Tensor]
) -> _Span | StridedCopy:
    if not (dst.is_contiguous() and src.is_contiguous()):
        return StridedCopy(item, int(src.storage_offset()), tuple(src.shape), src.stride(), dst)
    untyped = dst.untyped_storage()
    storage = storages.get(untyped.data_ptr())
    if storage is None:
        storage = torch.empty(0, dtype=torch.uint8, device=dst.device).set_(untyped)
        storages[untyped.data_ptr()] = storage
    src_start = item.start + int(src.storage_offset()) * item.dtype.itemsize
    dst_start = int(dst.storage_offset()) * dst.element_size()
    return _Span(src_start, item.dtype, storage, dst_start, dst.dtype, dst.numel())


def _merged(spans: Sequence[_Span | StridedCopy | LoaderCall]) -> tuple[Step, ...]:
    steps: list[Step] = []
    pending: _Span | None = None
    for span in spans:
        if isinstance(span, _Span) and pending is not None and span.follows(pending):
            pending = _Span(
                pending.src_start, pending.src_dtype, pending.storage, pending.dst_start,
                pending.dst_dtype, pending.numel + span.numel,
            )  # fmt: skip
            continue
        if pending is not None:
            steps.append(pending.run_step())
            pending = None
        if isinstance(span, _Span):
            pending = span
        else:
            steps.append(span)
    if pending is not None:
        steps.append(pending.run_step())
    return tuple(steps)
