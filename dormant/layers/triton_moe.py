"""The fused MoE experts in Triton: grouped GEMMs over the pairs sorted by expert.

``fused_experts`` picks the path by the number of pairs (a shape, so a graph captures one):
few (decode), the direct path of ``triton_moe_direct.py``, two kernels that read each pair's
expert straight from ``topk_ids``; more, this file's sorted path.

Same contract and rounding points as ``fused_experts_reference`` (``moe_reference.py``). The
sorted path is four kernels per call and no host sync (so it runs inside CUDA graphs and the
fused multi-step graph):

    align_by_expert    pairs sorted and padded by expert (triton_moe_routing.py)
    gate_up + SiLU·mul  h[p] = silu(x[t] @ w1_e.T) * (x[t] @ w3_e.T), one program per
                        (block of BLOCK_M rows of one expert, BLOCK_N columns of I): the gate
                        and up tiles share every load of x, and h is written once, activated
    down + weight       y[p] = (h[p] @ w2_e.T) * weight[p]
    combine             out[t] = sum_j y[t * k + j], in float32

Each program of a GEMM reads its block's expert id and the rows' pair ids; padding rows
(pair id ``num_pairs``) load nothing and store nothing, and blocks past ``num_padded`` return
at once. The grids depend only on the number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dormant.layers.triton_moe_direct import check_unit_strides, fused_experts_direct, is_direct
from dormant.layers.triton_moe_routing import align_by_expert


@dataclass(frozen=True)
class BlockConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def block_config(num_tokens: int, top_k: int, num_experts: int, n: int, k: int,
                 dtype: torch.dtype, is_gate_up: bool = False) -> BlockConfig:  # fmt: skip
    """Tile sizes for a GEMM with ``n`` output columns and depth ``k``.

    Up to 8 rows per expert on average (decode; vLLM's rule is tokens <= experts): 16-row
    blocks and long k tiles, since the step is reading weights. More: 64-row blocks. The
    gate/up kernel loads two weight tiles per step, so it takes half the columns per program:
    the same bytes in flight, twice the programs to spread over the SMs.
    """
    is_small = num_tokens * top_k <= 8 * num_experts
    block_m = 16 if is_small else 64
    widest_n = 32 if is_gate_up and is_small else 64
    block_n = max(16, min(widest_n, triton.next_power_of_2(n)))
    wide_k = 128 if dtype.itemsize <= 2 else 64
    block_k = max(16, min(wide_k if is_small else 64, triton.next_power_of_2(k)))
    num_stages = 4 if is_small and dtype.itemsize <= 2 else 3
    return BlockConfig(block_m, block_n, block_k, num_warps=4, num_stages=num_stages)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, N, K, stride_x, stride_we, stride_wn, stride_h,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    tokens = tl.where(is_pair, pairs // TOP_K, 0).to(tl.int64)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
    gate_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    up_ptrs = gate_ptrs + N * stride_wn  # the up rows follow the gate rows
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for first in range(0, K, BLOCK_K):
        is_k = ks < K - first
        x = tl.load(x_ptrs, mask=is_pair[:, None] & is_k[None, :], other=0.0)
        w_mask = is_k[:, None] & is_col[None, :]
        gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        acc_gate = tl.dot(x, gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, up, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = h_ptr.dtype.element_ty
    gate32 = acc_gate.to(dtype).to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(dtype)
    h = (silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * stride_h + cols[None, :]
    tl.store(h_ptrs, h, mask=is_pair[:, None] & is_col[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, y_ptr, weights_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, N, K, stride_h, stride_we, stride_wn, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    rows = tl.where(is_pair, pairs, 0).to(tl.int64)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_h + ks[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for first in range(0, K, BLOCK_K):
        is_k = ks < K - first
        h = tl.load(h_ptrs, mask=is_pair[:, None] & is_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=is_k[:, None] & is_col[None, :], other=0.0)
        acc = tl.dot(h, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=is_pair, other=0.0).to(dtype).to(tl.float32)
    y = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(
        y_ptr + rows[:, None] * stride_y + cols[None, :], y, mask=is_pair[:, None] & is_col[None, :]
    )


@triton.jit
def _combine_kernel(y_ptr, out_ptr, hidden, stride_y, stride_out, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    is_col = cols < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for slot in tl.static_range(TOP_K):
        row = y_ptr + (token * TOP_K + slot) * stride_y
        acc += tl.load(row + cols, mask=is_col, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=is_col)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``fused_experts_reference``'s contract: ``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``
    (the last dimension of each contiguous), float32 ``topk_weights`` and int32 ``topk_ids``
    ``[T, k]`` → ``[T, H]`` in ``x``'s dtype; by the direct path for few pairs, else sorted."""
    if is_direct(*topk_ids.shape):
        return fused_experts_direct(x, w13, w2, topk_weights, topk_ids)
    return fused_experts_sorted(x, w13, w2, topk_weights, topk_ids)


def fused_experts_sorted(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[BlockConfig, BlockConfig] | None = None,
) -> torch.Tensor:
    """``fused_experts``' contract by the pairs sorted by expert, for any number of tokens.
    ``configs`` (gate/up, down; one ``block_m``) overrides ``block_config``'s tiles, for
    tuning."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    check_unit_strides(x, w13, w2)
    num_pairs = num_tokens * top_k
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    up, down = configs or (
        block_config(num_tokens, top_k, num_experts, inter, hidden, x.dtype, is_gate_up=True),
        block_config(num_tokens, top_k, num_experts, hidden, inter, x.dtype),
    )
    if up.block_m != down.block_m:
        raise ValueError(f"one block_m for both GEMMs, got {up.block_m} and {down.block_m}")
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    sorted_pairs, block_experts, num_padded = align_by_expert(topk_ids, num_experts, up.block_m)
    num_blocks = block_experts.shape[0]
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, up.block_n))](
        x, w13, h, sorted_pairs, block_experts, num_padded,
        num_pairs, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_M=up.block_m, BLOCK_N=up.block_n, BLOCK_K=up.block_k,
        DOT_PRECISION=precision, num_warps=up.num_warps, num_stages=up.num_stages,
    )  # fmt: skip
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, down.block_n))](
        h, w2, y, topk_weights, sorted_pairs, block_experts, num_padded,
        num_pairs, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        DOT_PRECISION=precision, num_warps=down.num_warps, num_stages=down.num_stages,
    )  # fmt: skip
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block
    )
    return out
