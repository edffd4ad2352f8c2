"""Gated activations."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input laid out as ``[..., gate | up]`` (two equal halves)."""

    def forward(self, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
