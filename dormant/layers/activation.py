"""Gated activations (on the GPU, one fused Triton kernel: ``dormant.layers.triton_activation``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from dormant.layers.kernels import IS_TRITON_AVAILABLE, use_triton

if IS_TRITON_AVAILABLE:
    from dormant.layers.triton_activation import silu_and_mul


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input laid out as ``[..., gate | up]`` (two equal halves)."""

    def forward(self, x: Tensor) -> Tensor:
        if use_triton(x):
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
