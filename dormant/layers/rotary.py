"""Rotary position embedding, neox style (rotate halves), as HF Llama/Qwen3 apply it.

The cos/sin table is a derived, non-persistent buffer: after the model is built on ``meta`` and
materialized, ``init_buffers()`` recomputes it in place (its storage is kept, so an allocator
that placed it keeps owning it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Llama3RopeScaling:
    """The ``rope_type: llama3`` frequency scaling (Llama 3.1+)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"invalid llama3 rope scaling {self}")

    def apply(self, inv_freq: Tensor) -> Tensor:
        """Scales inverse frequencies exactly as HF ``_compute_llama3_parameters``."""
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos_sin_cache: Tensor  # a buffer (runtime memory under the engine)

    """Applies rotary embeddings to q and k at given positions.

    Buffer ``cos_sin_cache``: float32 ``[max_position_embeddings, head_dim]``, row p is
    ``[cos(p * f) | sin(p * f)]`` over the ``head_dim / 2`` inverse frequencies f.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float,
        scaling: Llama3RopeScaling | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.scaling = scaling
        # device=None: follows the ambient default device (``meta`` when built under it).
        cache = self._compute_cache(None)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _compute_cache(self, device: torch.device | None) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.base ** (exponents / self.head_dim))
        if self.scaling is not None:
            inv_freq = self.scaling.apply(inv_freq)
        positions = torch.arange(self.max_position_embeddings, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def init_buffers(self) -> None:
        """Recomputes ``cos_sin_cache`` in place, on the device it lives on."""
        cache = self.cos_sin_cache
        cache.copy_(self._compute_cache(cache.device))

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotates ``q`` and ``k``, each ``[num_tokens, num_heads * head_dim]`` or
        ``[num_tokens, num_heads, head_dim]``; ``positions`` is int64 ``[num_tokens]`` with
        values below ``max_position_embeddings``. Computes in float32; returns the input shapes
        and dtypes."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        shape = x.shape
        x32 = x.reshape(shape[0], -1, self.head_dim).float()
        x1, x2 = x32.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype).reshape(shape)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_position_embeddings={self.max_position_embeddings}, "
            f"base={self.base}, scaling={self.scaling}"
        )
