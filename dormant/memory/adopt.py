"""``adopt``: move an existing module's parameters and buffers into pool memory (DESIGN §2.4).

Works for any model. Parameters keep their identity (``param.data`` is swapped, so optimizers,
tied weights and hooks that hold the Parameter still see it); buffers are replaced in the module
that owns them. All parameters go into one block (few, large handles), and so do all buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dormant.memory.ranges import align_up

Spec = tuple[Sequence[int] | torch.Size, torch.dtype]
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


def adopt_module(
    module: torch.nn.Module, allocate_many: AllocateMany, tag: str, buffer_tag: str
) -> torch.nn.Module:
    """Swaps every parameter and buffer of ``module`` for pool memory holding the same values."""
    params = list(module.parameters())  # deduplicated: tied parameters are adopted once
    if params:
        new = allocate_many([(p.shape, p.dtype) for p in params], tag)
        for param, tensor in zip(params, new, strict=True):
            _fill(tensor, param.data)
            if param.device.type == "meta" or param.device != tensor.device:
                # ``.data`` cannot change a parameter's device: swap the whole tensor in place.
                swap = torch.nn.Parameter(tensor, requires_grad=param.requires_grad)
                torch.utils.swap_tensors(param, swap)
            else:
                param.data = tensor

    owners = [
        (m, name, buf)
        for m in module.modules()
        for name, buf in m._buffers.items()
        if buf is not None
    ]
    unique = list({id(buf): buf for _, _, buf in owners}.values())
    if unique:
        new = allocate_many([(b.shape, b.dtype) for b in unique], buffer_tag)
        replacement = {}
        for buf, tensor in zip(unique, new, strict=True):
            _fill(tensor, buf)
            replacement[id(buf)] = tensor
        for owner, name, buf in owners:
            owner._buffers[name] = replacement[id(buf)]
    return module


def _fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src.device.type != "meta":
        dst.copy_(src)
