"""Tensor-parallel process-group state.

Layers read the current group once, at construction, and keep it: a model built inside
``use_tp_group(group)`` (or after ``init_tp_group(group)``) is sharded for that group for its
whole life. The only module-level state is the *current* group, replaced only through the
explicit setters below. Without any setup it is a single-rank group whose collectives are
identities, so single-process code needs no ``torch.distributed`` at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor


class TPGroup(ABC):
    """A tensor-parallel group as the layers see it: a rank, a size, and two collectives.

    Invariant: ``0 <= rank < world_size``.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid TP rank {rank} for world size {world_size}")
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sums ``tensor`` over the group, in place; returns it."""

    @abstractmethod
    def all_gather(self, tensor: Tensor, dim: int) -> Tensor:
        """Concatenates every rank's ``tensor`` along ``dim``, in rank order (a new tensor).

        Precondition: all ranks pass tensors of the same shape and dtype.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


class SingleRankGroup(TPGroup):
    """The group of one: rank 0 of 1. Both collectives return their input unchanged."""

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=1)

    def all_reduce(self, tensor: Tensor) -> Tensor:
        return tensor

    def all_gather(self, tensor: Tensor, dim: int) -> Tensor:
        return tensor


class DistributedTPGroup(TPGroup):
    """A group backed by an initialized ``torch.distributed`` process group.

    Precondition: ``torch.distributed`` is initialized (NCCL on GPU, gloo on CPU) and this
    process belongs to ``process_group`` (``None`` means the default world group).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) before building a DistributedTPGroup"
            )
        self.process_group = process_group
        super().__init__(
            rank=dist.get_rank(process_group), world_size=dist.get_world_size(process_group)
        )
        # Kept, so that the group can be made again on the same ranks once destroyed.
        self.ranks = (
            list(range(self.world_size))
            if process_group is None
            else dist.get_process_group_ranks(process_group)
        )
        self.backend = str(dist.get_backend(process_group))

    def all_reduce(self, tensor: Tensor) -> Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group)
        return tensor

    def all_gather(self, tensor: Tensor, dim: int) -> Tensor:
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        # One collective into one buffer, ranks concatenated along dim 0 (a static shape);
        # then each rank's block is concatenated along ``dim``.
        gathered = torch.empty(
            (self.world_size * tensor.shape[0], *tensor.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        _all_gather_single(gathered, tensor, group=self.process_group)
        if dim % tensor.dim() == 0:
            return gathered
        return torch.cat(gathered.chunk(self.world_size, dim=0), dim=dim)


# ``all_gather_into_tensor`` was renamed ``all_gather_single`` (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_current_group: TPGroup = SingleRankGroup()


def get_tp_group() -> TPGroup:
    """Returns the current tensor-parallel group (a ``SingleRankGroup`` unless one was set)."""
    return _current_group


def init_tp_group(group: TPGroup) -> None:
    """Installs ``group`` as the current group for this process until replaced.

    Models built afterwards are sharded for it. Use ``use_tp_group`` for a scoped install.
    """
    global _current_group
    _current_group = group


def reset_tp_group() -> None:
    """Restores the single-rank default group."""
    init_tp_group(SingleRankGroup())


@contextmanager
def use_tp_group(group: TPGroup) -> Iterator[TPGroup]:
    """Installs ``group`` for the scope and restores the previous group on exit."""
    previous = get_tp_group()
    init_tp_group(group)
    try:
        yield group
    finally:
        init_tp_group(previous)


def all_reduce_min(value: int, group: TPGroup | None = None) -> int:
    """The minimum of ``value`` over the ranks of ``group`` (default: the current TP group),
    never over a wider world: under data parallelism other engines share the world group."""
    group = get_tp_group() if group is None else group
    if not isinstance(group, DistributedTPGroup) or group.world_size == 1:
        return value
    device = "cuda" if dist.get_backend(group.process_group) == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group.process_group)
    return int(tensor.item())
