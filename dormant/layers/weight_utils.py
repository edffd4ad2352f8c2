"""The weight-loading protocol shared by every layer.

A layer that shards or packs parameters defines two methods and attaches them, bound, to each
of its parameters (``set_weight_attrs``):

- ``weight_loader(param, loaded_weight, shard_id=None)``: takes the **full** (unsharded)
  checkpoint tensor and copies this rank's shard into ``param`` **in place**
  (``param.data.copy_``; the parameter is never rebound, so its address is stable).
- ``loaded_shape(param, shard_id=None)``: the full checkpoint shape that the loader accepts.

Parameters without them (norm weights) are replicated: ``default_weight_loader`` and
``default_loaded_shape`` apply.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

ShardId = str | int | tuple[int, str]  # tuple: (expert, projection) of a fused MoE layer


class WeightLoader(Protocol):
    def __call__(
        self, param: Tensor, loaded_weight: Tensor, shard_id: ShardId | None = None
    ) -> None: ...


class LoadedShape(Protocol):
    def __call__(self, param: Tensor, shard_id: ShardId | None = None) -> torch.Size: ...


def set_weight_attrs(param: nn.Parameter, loader: WeightLoader, loaded_shape: LoadedShape) -> None:
    """Attaches the loading protocol to ``param`` as plain attributes (kept by ``.data`` swaps;
    ``torch.utils.swap_tensors`` swaps them too, so copy ``__dict__`` when using it)."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.loaded_shape = loaded_shape  # type: ignore[attr-defined]


def check_loaded_shape(
    param: Tensor, loaded_weight: Tensor, expected: torch.Size, shard_id: ShardId | None
) -> None:
    """Raises ``ValueError`` unless ``loaded_weight`` has the full checkpoint shape ``expected``."""
    if loaded_weight.shape != expected:
        shard = "" if shard_id is None else f" (shard {shard_id!r})"
        raise ValueError(
            f"checkpoint tensor{shard} has shape {tuple(loaded_weight.shape)}, expected the full "
            f"unsharded shape {tuple(expected)} for a parameter of local shape {tuple(param.shape)}"
        )


def check_no_shard_id(shard_id: ShardId | None) -> None:
    """Raises ``ValueError`` if a shard id is passed to a loader of an unpacked parameter."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not packed; got shard id {shard_id!r}")


def default_loaded_shape(param: Tensor, shard_id: ShardId | None = None) -> torch.Size:
    """A replicated parameter loads its own shape."""
    check_no_shard_id(shard_id)
    return param.shape


def default_weight_loader(
    param: Tensor, loaded_weight: Tensor, shard_id: ShardId | None = None
) -> None:
    """Copies a replicated parameter whole, in place (casting dtype and device on copy)."""
    check_loaded_shape(param, loaded_weight, default_loaded_shape(param, shard_id), shard_id)
    param.data.copy_(loaded_weight)


def load_narrowed(
    destination: Tensor, loaded_weight: Tensor, dim: int, rank: int, num_ranks: int
) -> None:
    """Copies rank ``rank``'s contiguous 1/``num_ranks`` slice of ``loaded_weight`` along ``dim``
    into ``destination`` (a view of the parameter), in place."""
    size = destination.shape[dim]
    if loaded_weight.shape[dim] != size * num_ranks:
        raise ValueError(
            f"cannot shard dim {dim} of size {loaded_weight.shape[dim]} into {num_ranks} "
            f"parts of size {size}"
        )
    destination.copy_(loaded_weight.narrow(dim, rank * size, size))


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, raising ``ValueError`` naming ``what`` unless exact."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator
