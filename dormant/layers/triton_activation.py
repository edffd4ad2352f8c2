"""``silu(gate) * up`` as one Triton kernel, rounding where the torch reference does (after
the SiLU and after the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., 2n]`` laid out as ``[gate | up]`` (unit stride in the last dimension)
    → ``[..., n]``."""
    n = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * n)
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 2048)
    if rows.shape[0] > 0:
        grid = (rows.shape[0], triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](rows, out, n, rows.stride(0), out.stride(0), BLOCK=block)
    return out.view(*x.shape[:-1], n)
