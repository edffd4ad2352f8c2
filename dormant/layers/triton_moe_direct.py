"""The fused MoE experts at decode sizes: each pair reads its expert straight from ``topk_ids``.

Same contract and rounding points as ``fused_experts_reference`` (``moe_reference.py``) and the
sorted path (``triton_moe.py``). Two kernels per call, each a loop or a tile (``KERNELS``), no
sort, no host sync:

    gate_up + SiLU·mul   h[p] = silu(x[t] @ w1_e.T) * (x[t] @ w3_e.T), e = topk_ids[p]; one
                         program per (pair, BLOCK_N columns of I)
    down + combine       out[t] = sum_j ((h[t * k + j] @ w2_e.T) * weight[t, j]), e =
                         topk_ids[t, j]; one program per (token, BLOCK_N columns of H), looping
                         over the token's k experts in slot order

Each program reduces one row of x (or h) against a weight tile with float32 multiply-adds, no
``tl.dot`` (one token a program: nothing pads a matrix core's 16 rows). The down kernel rounds
each pair's result to the dtype, weights it, rounds again and adds it to a float32 sum in slot
order, as the sorted path's combine does: bit-identical given the same pair results, with no
atomics and no ``[T * k, H]`` buffer.

A pair re-reads its expert where another pair routes to it too (the sorted path reads each once):
this path is for few pairs (``is_direct``), where the sort costs more than the rereads (in L2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dormant.layers.triton_pdl import use_pdl

# num_tokens * top_k up to this: the direct path (top-8: batch <= 4). Measured on the H200
# (benchmarks/moe_kernels.py, Qwen3-30B-A3B dims, per layer): direct / sorted 0.96 at batch 1,
# 0.96 at 2, 0.99 at 4, 1.12 at 8, 1.25 at 16 (results/2026-12-01d-run2-moe12.jsonl).
DIRECT_MAX_PAIRS = 32

# The batch-1 choices, each measured by benchmarks/moe_b1_sweep.py on the H200 (set them here):
# - KERNELS: "loop" (_gate_up_direct_kernel, then _down_combine_kernel: a token's slots one
#   after another), "tile" (then _down_tile_kernel: every slot's whole depth in one tile, all
#   its loads in flight at once), "tile-all" (the default since the sixteenth session: gate/up
#   in whole-depth tiles too, _gate_up_tile_kernel). Qwen3-30B-A3B's norm -> router -> experts
#   chain at batch 1, graph replay, per layer: loop + PDL 33.6 us, tile + PDL 31.8, tile-all +
#   PDL 28.8; the experts alone at batch 1 / 2 / 4: tile 30.4 / 54.2 / 87.1 us, tile-all 27.3 /
#   48.4 / 86.0; the engine's 48-layer step (its 4-step graph, with pdl_tiles' new rule) 2.105
#   -> 1.91-1.98 x its roofline (results/2026-12-04-run{2,3,6}-*). (Gate/up and down fused per
#   block of I, plus a combine, lost at every tile.)
# - USE_PDL: programmatic dependent launch (triton_pdl.py): each launch hides behind the kernel
#   before it; the tile down kernel loads its weights before gate/up ends (bit-exact against plain
#   launches, tests/gpu/test_triton_moe.py).
KERNELS = "tile-all"
USE_PDL = True
KERNEL_CHOICES = ("loop", "tile", "tile-all")


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of one direct kernel: ``block_n`` output columns a program, ``block_k`` a step."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def check_unit_strides(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Both paths read rows of ``x``, ``w13`` and ``w2`` as contiguous runs."""
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_experts needs unit stride in the last dimension of x, w13, w2")


def is_direct(num_tokens: int, top_k: int) -> bool:
    """Whether ``fused_experts`` takes this path for a batch of ``num_tokens``."""
    return num_tokens * top_k <= DIRECT_MAX_PAIRS


def gemv_config(n: int, k: int, is_gate_up: bool, kernels: str = "loop") -> GemvConfig:
    """Default tiles for ``n`` output columns of depth ``k``, sized for Qwen3-30B-A3B on 132
    SMs (weights stream once: what counts is the bytes in flight per SM). "loop": gate/up 16
    columns of each (I = 768: 384 programs at batch 1), k in pipelined steps of 256; down 4
    columns (H = 2048: 512 programs a token), k in unrolled steps of 256. "tile": down 2
    columns of the whole depth for every slot. "tile-all": gate/up one column of each over the
    whole depth at 2 warps (6144 programs at batch 1), down one column. ``block_k`` is unused
    where a tile spans ``k``."""
    if not is_gate_up and kernels == "tile":
        return GemvConfig(block_n=max(1, min(2, triton.next_power_of_2(n))), block_k=1024)
    if kernels == "tile-all":
        return GemvConfig(1, k, num_warps=2) if is_gate_up else GemvConfig(1, 1024)
    block_n = 16 if is_gate_up else 4
    return GemvConfig(
        block_n=max(1, min(block_n, triton.next_power_of_2(n))),
        block_k=max(16, min(256, triton.next_power_of_2(k))),
    )


@triton.jit
def _pair_of_program(ids_ptr, TOP_K: tl.constexpr, USE_PDL: tl.constexpr):
    """A gate/up program's (pair, token, expert); under PDL after the wait on the router's ids,
    and then the down kernel may launch (triton_pdl.py)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    pair = tl.program_id(0)
    return pair, (pair // TOP_K).to(tl.int64), tl.load(ids_ptr + pair).to(tl.int64)


@triton.jit
def _store_silu_mul(h_ptr, pair, stride_h, cols, is_col, gate_sums, up_sums):
    """``h = silu(gate) * up`` at the sorted path's rounding points, into the pair's row."""
    dtype = h_ptr.dtype.element_ty
    gate32 = gate_sums.to(dtype).to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(dtype)
    h = (silu.to(tl.float32) * up_sums.to(dtype).to(tl.float32)).to(dtype)
    tl.store(h_ptr + pair.to(tl.int64) * stride_h + cols, h, mask=is_col)


@triton.jit
def _gate_up_direct_kernel(
    x_ptr, w_ptr, h_ptr, ids_ptr, N, K, stride_x, stride_we, stride_wn, stride_h,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pair, token, expert = _pair_of_program(ids_ptr, TOP_K, USE_PDL)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_x + ks
    gate_ptrs = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    up_ptrs = gate_ptrs + N * stride_wn  # the up rows follow the gate rows
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for first in range(0, K, BLOCK_K):
        is_k = ks < K - first
        x = tl.load(x_ptrs, mask=is_k, other=0.0).to(tl.float32)[None, :]
        w_mask = is_col[:, None] & is_k[None, :]
        acc_gate += tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    _store_silu_mul(h_ptr, pair, stride_h, cols, is_col, tl.sum(acc_gate, 1), tl.sum(acc_up, 1))


@triton.jit
def _gate_up_tile_kernel(
    x_ptr, w_ptr, h_ptr, ids_ptr, N, stride_x, stride_we, stride_wn, stride_h,
    K: tl.constexpr, K_PAD: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # _gate_up_direct_kernel's sums over one [BLOCK_N, K] tile per projection: every load of
    # the program issues at once, right after the wait (as _down_tile_kernel's for down)
    pair, token, expert = _pair_of_program(ids_ptr, TOP_K, USE_PDL)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    ks = tl.arange(0, K_PAD)
    w_mask = is_col[:, None] & (ks < K)[None, :]
    gate_ptrs = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
    up = tl.load(gate_ptrs + N * stride_wn, mask=w_mask, other=0.0)  # the up rows follow
    x = tl.load(x_ptr + token * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
    gate_sums, up_sums = tl.sum(gate.to(tl.float32) * x, 1), tl.sum(up.to(tl.float32) * x, 1)
    _store_silu_mul(h_ptr, pair, stride_h, cols, is_col, gate_sums, up_sums)


@triton.jit
def _down_combine_kernel(
    h_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, N, stride_h, stride_we, stride_wn, stride_out,
    K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:  # h is gate/up's: nothing is read before it is out; then the next layer's
        gdc_wait()  # norm may launch (it waits for our output: triton_norm.py)
        gdc_launch_dependents()
    # K (the intermediate size) is a compile-time constant, so both loops unroll into straight
    # code and the loads of later slots can be issued before the sums of earlier ones.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    ks = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        h_row = h_ptr + pair * stride_h
        w_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for first in tl.static_range(0, K, BLOCK_K):
            is_k = ks < K - first
            h = tl.load(h_row + first + ks, mask=is_k, other=0.0, cache_modifier=".cg")
            h = h.to(tl.float32)
            w = tl.load(
                w_rows + first + ks[None, :], mask=is_col[:, None] & is_k[None, :], other=0.0
            )
            acc += w.to(tl.float32) * h[None, :]
        weight = tl.load(weights_ptr + pair).to(dtype).to(tl.float32)
        y = tl.sum(acc, axis=1).to(dtype).to(tl.float32)
        total += (y * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, total.to(dtype), mask=is_col)


@triton.jit
def _down_tile_kernel(
    h_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, N, stride_h, stride_we, stride_wn, stride_out,
    K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr,
    SLOTS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # _down_combine_kernel's sums with the slots as a dimension of one [slot, column, depth]
    # tile: every load of the program is issued at once, before the wait on gate/up under PDL
    # (the ids are the router's, out before gate/up triggered: triton_pdl.py).
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slots = tl.arange(0, SLOTS_PAD)
    ks = tl.arange(0, K_PAD)
    is_slot = slots < TOP_K
    pairs = token * TOP_K + slots
    experts = tl.load(ids_ptr + pairs, mask=is_slot, other=0, cache_modifier=".cg").to(tl.int64)
    w_ptrs = w_ptr + (experts * stride_we)[:, None, None] + ks[None, None, :]
    w_ptrs += (cols.to(tl.int64) * stride_wn)[None, :, None]
    w_mask = is_slot[:, None, None] & (cols < N)[None, :, None] & (ks < K)[None, None, :]
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if USE_PDL:  # then the next layer's norm may launch (it waits for our output)
        gdc_wait()
        gdc_launch_dependents()
    h_mask = is_slot[:, None] & (ks < K)[None, :]
    h_ptrs = h_ptr + pairs[:, None] * stride_h + ks[None, :]
    h = tl.load(h_ptrs, mask=h_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(w.to(tl.float32) * h[:, None, :], axis=2).to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + pairs, mask=is_slot, other=0.0).to(dtype).to(tl.float32)
    weighted = (y * weight[:, None]).to(dtype).to(tl.float32)  # [slot, column]
    total = tl.zeros([BLOCK_N], tl.float32)
    for slot in tl.static_range(TOP_K):  # the slot order of the sorted path's combine
        total += tl.sum(tl.where(slots[:, None] == slot, weighted, 0.0), axis=0)  # one term
    tl.store(out_ptr + token * stride_out + cols, total.to(dtype), mask=cols < N)


def fused_experts_direct(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[GemvConfig, GemvConfig] | None = None,
    *,
    kernels: str | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``fused_experts``' contract (``triton_moe.py``) without the sort: for any number of
    tokens, fastest for few pairs (``is_direct``). For tuning, ``kernels`` overrides
    ``KERNELS``, ``pdl`` ``USE_PDL`` (off where the device has no PDL) and ``configs`` (gate/up,
    down) ``gemv_config``'s tiles: every choice has the same rounding points and the same slot
    order in the combine."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    check_unit_strides(x, w13, w2)
    kernels = kernels or KERNELS
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    is_pdl = use_pdl(pdl, USE_PDL, x.device)
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    up, down = configs or (gemv_config(inter, hidden, True, kernels),
                           gemv_config(hidden, inter, False, kernels))  # fmt: skip
    num_pairs = num_tokens * top_k
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    up_grid = (num_pairs, triton.cdiv(inter, up.block_n))
    up_launch = {"num_warps": up.num_warps, "num_stages": up.num_stages, "launch_pdl": is_pdl}
    if kernels == "tile-all":
        _gate_up_tile_kernel[up_grid](
            x, w13, h, topk_ids, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
            K=hidden, K_PAD=triton.next_power_of_2(hidden), TOP_K=top_k, BLOCK_N=up.block_n,
            USE_PDL=is_pdl, **up_launch,
        )  # fmt: skip
    else:
        _gate_up_direct_kernel[up_grid](
            x, w13, h, topk_ids, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1),
            h.stride(0), TOP_K=top_k, BLOCK_N=up.block_n, BLOCK_K=up.block_k, USE_PDL=is_pdl,
            **up_launch,
        )  # fmt: skip
    grid = (num_tokens, triton.cdiv(hidden, down.block_n))
    args = (h, w2, out, topk_weights, topk_ids, hidden, h.stride(0), w2.stride(0), w2.stride(1),
            out.stride(0))  # fmt: skip
    launch = {"num_warps": down.num_warps, "num_stages": down.num_stages, "launch_pdl": is_pdl}
    if kernels in ("tile", "tile-all"):
        _down_tile_kernel[grid](
            *args, K=inter, TOP_K=top_k, BLOCK_N=down.block_n,
            K_PAD=triton.next_power_of_2(inter), SLOTS_PAD=triton.next_power_of_2(top_k),
            USE_PDL=is_pdl, **launch,
        )  # fmt: skip
    else:
        _down_combine_kernel[grid](
            *args, K=inter, TOP_K=top_k, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
            USE_PDL=is_pdl, **launch,
        )  # fmt: skip
    return out
