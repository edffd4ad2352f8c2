"""RMSNorm with the exact arithmetic of Hugging Face Llama/Qwen3 (on the GPU, one fused Triton
kernel with the same rounding points: ``dormant.layers.triton_norm``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dormant.layers.kernels import IS_TRITON_AVAILABLE, use_triton

if IS_TRITON_AVAILABLE:
    from dormant.layers.triton_norm import rms_norm


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``: normalised in float32, cast back to the input dtype, then
    scaled by the weight (the order HF uses, so bf16 results match bit for bit)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        """Normalises over the last dimension; any leading shape."""
        if use_triton(x):
            return rms_norm(x, self.weight, self.eps)[0]
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """Adds the residual in the input dtype (as HF does) and normalises.

        Returns ``(normalised, new_residual)`` where ``new_residual = x + residual``.
        """
        if use_triton(x):
            normed, new_residual = rms_norm(x, self.weight, self.eps, residual)
            assert new_residual is not None
            return normed, new_residual
        residual = x + residual
        return self(residual), residual

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
