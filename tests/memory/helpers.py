"""Test helpers for the memory layer."""

from __future__ import annotations

import torch


def random_fill(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """Fills ``tensor`` with random bytes (every bit pattern, NaNs included) and returns a copy."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (tensor.numel() * tensor.element_size(),), dtype=torch.uint8, generator=generator
    )
    tensor.view(-1).view(torch.uint8).copy_(raw.to(tensor.device))
    return tensor.clone()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included)."""
    return torch.equal(a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu())
