"""What a weight loader copies where, found by running it on a ``meta`` probe (``copy_plan.py``).

A layer's ``weight_loader`` is run once on a ``meta`` tensor of the checkpoint tensor's shape and
dtype, under a dispatch mode that records its ``copy_`` calls (destination view, source view)
instead of running them. A loader that writes its parameter any other way, or copies from
anything but the probe into anything but its parameter, is untraceable: the plan calls it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from dormant.models.weights import WeightTarget


class _Untraceable(Exception):
    """A weight loader did something other than ``copy_`` into its parameter: call it."""


class _CopyRecorder(TorchDispatchMode):
    """Records ``copy_(dst, src)`` instead of running it; refuses any other write."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[Tensor, Tensor]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.copy_.default and not kwargs:
            self.copies.append((args[0], args[1]))
            return args[0]
        if func._schema.is_mutable:
            raise _Untraceable(str(func))
        return func(*args, **(kwargs or {}))


def traced_copies(
    target: WeightTarget, shape: torch.Size, dtype: torch.dtype
) -> list[tuple[Tensor, Tensor]] | None:
    """The copies ``target``'s loader makes of a checkpoint tensor of ``shape`` and ``dtype``, as
    (destination view, source view of the probe), or None if the loader does anything a
    recorded plan could not repeat (it then has to be called)."""
    probe = torch.empty(shape, dtype=dtype, device="meta")
    recorder = _CopyRecorder()
    try:
        with torch.no_grad(), recorder:
            target.loader(target.tensor, probe, target.shard_id)
    except Exception:
        return None
    probe_storage = probe.untyped_storage()._cdata
    storage = target.tensor.untyped_storage()
    for dst, src in recorder.copies:
        is_probe = src.is_meta and src.untyped_storage()._cdata == probe_storage
        is_param = dst.device == target.tensor.device and (
            dst.untyped_storage().data_ptr() == storage.data_ptr()
        )
        if not (is_probe and is_param and dst.shape == src.shape):
            return None
    return recorder.copies
