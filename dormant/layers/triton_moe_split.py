"""The direct MoE path split along the intermediate size: gate/up and down fused per block of I.

``triton_moe_direct.py``'s contract and rounding points, in two kernels instead of its gate/up
then down, with no kernel boundary between an expert's gate/up rows and its down columns:

    gate/up/down   one program per (pair, BLOCK_I rows of I): h = silu(x @ w1_e.T) * (x @ w3_e.T)
                   on its rows (rounded as the direct kernel does), then its share of the down
                   GEMV, partial[pair, block, :] = w2_e[:, rows] @ h[rows], float32
    combine        one program per (token, BLOCK_H columns of H): y = the partials of a pair
                   summed over the blocks in one fixed order, rounded to the dtype, then
                   weighted and rounded, and added to a float32 sum in slot order

Why: at batch 1 the two direct kernels each stream their weights with a ramp-up and a tail of
their own (16.7 us for 50 MB and 11.8 us for 25 MB on the H200, about 4.2 TB/s would be 12 and
6). Here the 75 MB stream in one kernel; programs in their gate/up phase and programs in their
down phase share each SM, and the combine reads back ``num_pairs * (I / BLOCK_I) * H`` floats
(3 MB at Qwen3-30B-A3B, BLOCK_I 16), which L2 holds.

The partial sums change the order of each pair's down sum against the direct path (float32
either way); the combine is the same: given the same pair results, the same output bits.
Deterministic, no atomics. Precondition (``fused_experts_direct`` checks it): unit stride in the
last dimension of ``x``, ``w13`` and ``w2``, contiguous ``topk_ids`` and ``topk_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@dataclass(frozen=True)
class SplitConfig:
    """``block_i`` rows of I per program, ``block_k`` of H per gate/up step, ``block_h``
    columns of H per down step; ``combine_block_h`` columns per combine program."""

    block_i: int
    block_k: int
    block_h: int
    num_warps: int = 4
    num_stages: int = 3
    combine_block_h: int = 16


def split_config(inter: int, hidden: int) -> SplitConfig:
    """16 rows of I (Qwen3-30B-A3B's 768: 48 blocks, 384 programs at batch 1, about three per
    SM of 132), gate/up in steps of 256, down in steps of 256 columns."""
    return SplitConfig(
        block_i=max(1, min(16, triton.next_power_of_2(inter))),
        block_k=max(16, min(256, triton.next_power_of_2(hidden))),
        block_h=max(16, min(256, triton.next_power_of_2(hidden))),
    )


@triton.jit
def _gate_up_down_kernel(
    x_ptr, w13_ptr, w2_ptr, ids_ptr, part_ptr, INTER, H, stride_x, stride_w13e, stride_w13n,
    stride_w2e, stride_w2n,
    TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:  # the router's ids are out; then the combine may launch (triton_pdl.py)
        gdc_wait()
        gdc_launch_dependents()
    pair = tl.program_id(0)
    block = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = block * BLOCK_I + tl.arange(0, BLOCK_I)
    is_row = rows < INTER
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_x + ks
    gate_ptrs = w13_ptr + expert * stride_w13e + rows[:, None].to(tl.int64) * stride_w13n
    gate_ptrs += ks[None, :]
    up_ptrs = gate_ptrs + INTER * stride_w13n  # the up rows follow the gate rows
    acc_gate = tl.zeros([BLOCK_I, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_I, BLOCK_K], tl.float32)
    for first in range(0, H, BLOCK_K):
        is_k = ks < H - first
        x = tl.load(x_ptrs, mask=is_k, other=0.0).to(tl.float32)[None, :]
        w_mask = is_row[:, None] & is_k[None, :]
        acc_gate += tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = x_ptr.dtype.element_ty
    gate32 = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(dtype)  # the sorted path's formula
    h = (silu.to(tl.float32) * tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)).to(dtype)
    h = h.to(tl.float32)
    cs = tl.arange(0, BLOCK_H)
    w2_ptrs = w2_ptr + expert * stride_w2e + cs[:, None].to(tl.int64) * stride_w2n + rows[None, :]
    part_ptrs = part_ptr + (pair.to(tl.int64) * tl.num_programs(1) + block) * H + cs
    for first in range(0, H, BLOCK_H):
        is_c = cs < H - first
        w = tl.load(w2_ptrs, mask=is_c[:, None] & is_row[None, :], other=0.0)
        tl.store(part_ptrs, tl.sum(w.to(tl.float32) * h[None, :], axis=1), mask=is_c)
        w2_ptrs += BLOCK_H * stride_w2n
        part_ptrs += BLOCK_H


@triton.jit
def _combine_kernel(
    part_ptr, out_ptr, weights_ptr, H, stride_out,
    TOP_K: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:  # the partials are the previous kernel's
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    is_col = cols < H
    blocks = tl.arange(0, BLOCKS_PAD)
    mask = (blocks < NUM_BLOCKS)[:, None] & is_col[None, :]
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_H], tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        offsets = (pair * NUM_BLOCKS + blocks[:, None]) * H + cols[None, :]
        partials = tl.load(part_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        y = tl.sum(partials, axis=0).to(dtype).to(tl.float32)  # the pair's down GEMV
        weight = tl.load(weights_ptr + pair).to(dtype).to(tl.float32)
        total += (y * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, total.to(dtype), mask=is_col)


def fused_experts_split(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: SplitConfig,
    pdl: bool,
) -> torch.Tensor:
    """``fused_experts_direct``'s result by the two kernels of the module docstring, for
    ``num_tokens >= 1`` under its preconditions. ``pdl``: launch both with PDL (the caller
    checks the device has it)."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    num_blocks = triton.cdiv(inter, config.block_i)
    partials = torch.empty((num_pairs, num_blocks, hidden), dtype=torch.float32, device=x.device)
    _gate_up_down_kernel[(num_pairs, num_blocks)](
        x, w13, w2, topk_ids, partials, inter, hidden, x.stride(0), w13.stride(0),
        w13.stride(1), w2.stride(0), w2.stride(1), TOP_K=top_k, BLOCK_I=config.block_i,
        BLOCK_K=config.block_k, BLOCK_H=config.block_h, USE_PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    out = torch.empty_like(x)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, config.combine_block_h))](
        partials, out, topk_weights, hidden, out.stride(0), TOP_K=top_k, NUM_BLOCKS=num_blocks,
        BLOCKS_PAD=triton.next_power_of_2(num_blocks), BLOCK_H=config.combine_block_h,
        USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out
