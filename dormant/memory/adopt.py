"""``adopt``: move an existing module's parameters and buffers into pool memory (DESIGN §2.4).

Works for any model. Parameters keep their identity (``param.data`` is swapped, so optimizers,
tied weights and hooks that hold the Parameter still see it); buffers are replaced in the module
that owns them. All parameters go into one block (few, large handles), and so do all buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dormant.memory.ranges import align_up

Shape = Sequence[int] | torch.Size
Spec = tuple[Shape, torch.dtype]
AllocateMany = Callable[[Sequence[Spec], str], list[torch.Tensor]]


def tensor_specs(specs: Sequence[Spec], alignment: int) -> tuple[list[tuple[int, int]], int]:
    """(offset, nbytes) of each tensor packed at ``alignment``, and the total bytes."""
    layout, offset = [], 0
    for shape, dtype in specs:
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * dtype.itemsize
        layout.append((offset, nbytes))
        offset = align_up(offset + nbytes, alignment)
    total = max((o + n for o, n in layout), default=0)
    return layout, total


def pack_views(
    raw: torch.Tensor, specs: Sequence[Spec], layout: Sequence[tuple[int, int]]
) -> list[torch.Tensor]:
    """The tensors of ``specs`` viewing the uint8 tensor ``raw`` at ``layout``'s offsets."""
    return [raw[o : o + n].view(d).view(s) for (s, d), (o, n) in zip(specs, layout, strict=True)]


def adopt_module(
    module: torch.nn.Module, allocate_many: AllocateMany, tag: str, buffer_tag: str
) -> torch.nn.Module:
    """Swaps every parameter and buffer of ``module`` for pool memory holding the same values.

    A parameter already on the pool's device keeps its identity (``param.data`` is swapped);
    one on another device (``meta`` included) is replaced, in every module that shares it, by a
    new Parameter. Tied parameters and shared buffers stay tied.
    """
    _move(module, "_parameters", allocate_many, tag)
    _move(module, "_buffers", allocate_many, buffer_tag)
    return module


def _move(module: torch.nn.Module, slot: str, allocate_many: AllocateMany, tag: str) -> None:
    owners = [
        (owner, name, tensor)
        for owner in module.modules()
        for name, tensor in getattr(owner, slot).items()
        if tensor is not None
    ]
    unique = list({id(t): t for _, _, t in owners}.values())
    if not unique:
        return
    new = allocate_many([(t.shape, t.dtype) for t in unique], tag)
    replacement = {id(old): _adopted(old, fresh) for old, fresh in zip(unique, new, strict=True)}
    for owner, name, tensor in owners:
        getattr(owner, slot)[name] = replacement[id(tensor)]


def _adopted(old: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """``fresh`` holding ``old``'s values, as the same Parameter object where that is possible."""
    if old.device.type != "meta":
        fresh.copy_(old.detach())
    if not isinstance(old, torch.nn.Parameter):
        return fresh
    if old.device == fresh.device:
        old.data = fresh
        return old
    return torch.nn.Parameter(fresh, requires_grad=old.requires_grad)
