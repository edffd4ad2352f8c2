"""``silu(gate) * up`` as one Triton kernel, rounding where the torch reference does (after
the SiLU and after the product).

The kernel can launch with programmatic dependent launch (``triton_pdl.py``): it reads nothing
before its wait (its input is the gate/up projection's), then lets the down projection launch,
and reads the input from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dormant.layers.triton_pdl import pdl_for

# PDL at one row (a batch-1 decode step: not measured), and at more (larger decode batches,
# prefill: with the other kernels' knobs it saved under 1 % of the dense layer at batch 64-256 in
# benchmarks/dense_decode_sweep.py on the H200, results/2026-12-03-run2-dense-sweep.jsonl).
USE_PDL_AT_BATCH_1 = False
USE_PDL_ABOVE_BATCH_1 = False


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, n, stride_x, stride_out, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    CACHE: tl.constexpr,
):  # fmt: skip
    if USE_PDL:  # x is the gate/up projection's; then the down projection may launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0, cache_modifier=CACHE)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0, cache_modifier=CACHE)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, *, pdl: bool | None = None) -> torch.Tensor:
    """``x`` ``[..., 2n]`` laid out as ``[gate | up]`` (unit stride in the last dimension)
    → ``[..., n]``. ``pdl`` overrides the PDL knobs (``triton_pdl.pdl_for``; off where the
    device has no PDL), for tuning."""
    n = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * n)
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 2048)
    is_pdl = pdl_for(rows.shape[0], pdl, USE_PDL_AT_BATCH_1, USE_PDL_ABOVE_BATCH_1, x.device)
    if rows.shape[0] > 0:
        grid = (rows.shape[0], triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](
            rows, out, n, rows.stride(0), out.stride(0), BLOCK=block, USE_PDL=is_pdl,
            CACHE=".cg" if is_pdl else "",  # from L2 after the wait: this SM's L1 may be stale
            launch_pdl=is_pdl,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
