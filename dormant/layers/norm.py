"""RMSNorm with the exact arithmetic of Hugging Face Llama/Qwen3."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``: normalised in float32, cast back to the input dtype, then
    scaled by the weight (the order HF uses, so bf16 results match bit for bit)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        """Normalises over the last dimension; any leading shape."""
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """Adds the residual in the input dtype (as HF does) and normalises.

        Returns ``(normalised, new_residual)`` where ``new_residual = x + residual``.
        """
        residual = x + residual
        return self(residual), residual

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
