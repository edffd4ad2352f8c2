"""RMSNorm, optionally with the residual add, as one Triton kernel per call.

Rounds where ``RMSNorm`` (the reference) does: the residual sum is rounded to the input dtype,
normalised in float32, rounded again, then scaled by the weight and rounded. Only the order of
the float32 sum of squares differs from torch's, so results agree to the last bit almost
always and to one unit in the last place otherwise.

At batch 1 (one row) the kernel can launch with programmatic dependent launch
(``USE_PDL_AT_BATCH_1``, ``triton_pdl.py``): it loads its weight while the kernel before it ends,
waits, then reads ``x`` and the residual from L2, and lets the next kernel (the router, or a PDL
GEMV) launch. Off by default until ``benchmarks/moe_b1_sweep.py --only layer`` measures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dormant.layers.triton_pdl import pdl_for

# One row only (a batch-1 decode step): launch with PDL (triton_pdl.py). On since the engine's GPU
# tests passed with it (2026-12-02f run 1); benchmarks/moe.py's knobs-off child turns it off.
USE_PDL_AT_BATCH_1 = True
# Every other launch (more than one row: larger decode batches, prefill) with PDL too. Off: in
# benchmarks/dense_decode_sweep.py on the H200 it saved under 1 % of the dense layer at batch
# 64-256 (results/2026-12-03-run2-dense-sweep.jsonl).
USE_PDL_ABOVE_BATCH_1 = False


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, residual_out_ptr, out_ptr, weight_ptr, n, eps,
    stride_x, stride_residual, stride_residual_out, stride_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    CACHE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a weight: before any wait
    if USE_PDL:  # x and the residual are earlier kernels'; then the next kernel may launch
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0, cache_modifier=CACHE)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0,
                           cache_modifier=CACHE)  # fmt: skip
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / n
    normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalises the rows of ``x`` (``[..., n]``, unit stride in the last dimension).

    With ``residual`` (``x``'s shape and dtype) the input is ``x + residual``, and that sum is
    returned as the second value, in a new tensor; ``x`` and ``residual`` are never written.
    Precondition: ``weight`` is ``[n]`` in ``x``'s dtype. ``pdl`` overrides the
    PDL knobs (``triton_pdl.pdl_for``; off where the device has no PDL), for tuning.
    """
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    residual_rows = residual.reshape(-1, n) if residual is not None else rows
    residual_out = torch.empty_like(out) if residual is not None else out
    is_pdl = pdl_for(rows.shape[0], pdl, USE_PDL_AT_BATCH_1, USE_PDL_ABOVE_BATCH_1, x.device)
    if rows.shape[0] > 0:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, residual_out, out, weight, n, eps,
            rows.stride(0), residual_rows.stride(0), residual_out.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n), USE_PDL=is_pdl,
            CACHE=".cg" if is_pdl else "",  # from L2 after the wait: this SM's L1 may be stale
            num_warps=min(max(triton.next_power_of_2(n) // 512, 1), 8), launch_pdl=is_pdl,
        )  # fmt: skip
    new_residual = residual_out.view(x.shape) if residual is not None else None
    return out.view(x.shape), new_residual
