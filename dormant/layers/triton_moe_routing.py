"""Routing on the device for the fused MoE kernels: top-k softmax, and the pairs sorted and
padded by expert (vLLM's ``moe_align_block_size``). Neither reads anything on the host, so both
run inside CUDA graphs; the shapes they produce depend only on the number of tokens.

Sorted layout (``BLOCK_M`` rows per block; pair ``p = t * top_k + j`` of token t's slot j):

| output            | shape                  | holds                                          |
|-------------------|------------------------|------------------------------------------------|
| ``sorted_pairs``  | int32 ``[max_padded]`` | expert e's pairs from row ``start_e``, then padding |
| ``block_experts`` | int32 ``[num_blocks]`` | the expert of block b's rows (``>= E``: unused) |
| ``num_padded``    | int32 ``[1]``          | ``sum_e pad(count_e)``: the rows in use        |

Expert e owns rows ``[start_e, start_e + pad(count_e))``; the ones past its ``count_e`` pairs
hold ``num_pairs`` (padding). ``pad(c)`` rounds c up to a multiple of ``BLOCK_M``, and
``start_e = sum_{e' < e} pad(count_e')``. At most
``max_padded = num_pairs + min(E, num_pairs) * (BLOCK_M - 1)`` rows are in use. Within an
expert the pairs' order is whatever the atomics give: each pair's result is computed from its
own row alone, so the order changes no value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN_CHUNK = 1024  # pairs per loop iteration of the (single-program) align kernel
BLOCKS_CHUNK = 64  # blocks per iteration when writing block_experts


@triton.jit
def softmax_topk_row(
    row_ptr, weights_ptr, ids_ptr, num_experts,
    EXPERTS_PAD: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """One token's routing: its ``num_experts`` logits at ``row_ptr`` → ``TOP_K`` float32
    weights and int32 ids. ``topk_softmax`` and the fused router (``triton_router.py``) both
    call it, so equal logits give equal results. ``CACHE``: the logits' load cache modifier."""
    experts = tl.arange(0, EXPERTS_PAD)
    is_expert = experts < num_experts
    logits = tl.load(row_ptr + experts, mask=is_expert, other=float("-inf"), cache_modifier=CACHE)
    logits = logits.to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))
    probs = exps / tl.sum(exps, axis=0)
    # Ranks: real probabilities >= 0 > NaN (-1) > padding (-2) > taken (-3). A NaN row still
    # picks top_k distinct real experts, so the ids stay in [0, num_experts) whatever the input.
    probs = tl.where(probs == probs, probs, -1.0)
    probs = tl.where(is_expert, probs, -2.0)
    slots = tl.arange(0, TOP_K_PAD)
    top_weights = tl.zeros([TOP_K_PAD], tl.float32)
    top_ids = tl.zeros([TOP_K_PAD], tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=0)
        top_weights = tl.where(slots == slot, tl.max(probs, axis=0), top_weights)
        top_ids = tl.where(slots == slot, best.to(tl.int32), top_ids)
        probs = tl.where(experts == best, -3.0, probs)  # taken
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=0)
    tl.store(weights_ptr + slots, top_weights, mask=slots < TOP_K)
    tl.store(ids_ptr + slots, top_ids, mask=slots < TOP_K)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_logits, num_experts,
    EXPERTS_PAD: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    softmax_topk_row(
        logits_ptr + token * stride_logits, weights_ptr + token * TOP_K, ids_ptr + token * TOP_K,
        num_experts, EXPERTS_PAD, TOP_K, TOP_K_PAD, RENORMALIZE, CACHE="",
    )  # fmt: skip


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts`` in one kernel: ``[T, E]`` logits → float32 weights and int32 ids
    ``[T, top_k]``, in descending probability (ties: the lower expert id first)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens > 0:
        experts_pad = triton.next_power_of_2(num_experts)
        # One warp up to 256 experts: each of the 2 * top_k reductions is then warp shuffles
        # alone, no shared memory and barrier between warps (a decode step's row is latency).
        _topk_softmax_kernel[(num_tokens,)](
            router_logits, weights, ids, router_logits.stride(0), num_experts,
            EXPERTS_PAD=experts_pad, TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize, num_warps=1 if experts_pad <= 256 else 4,
        )  # fmt: skip
    return weights, ids


@triton.jit
def _align_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr, cursor_ptr,
    num_pairs, max_padded, num_blocks,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
):  # fmt: skip
    # One program: count the pairs of every expert (padding lanes count as expert E, a bin
    # that is then dropped), lay the experts out, then scatter the pairs with atomic cursors.
    bins = tl.arange(0, EXPERTS_PAD)
    counts = tl.zeros([EXPERTS_PAD], tl.int32)
    for first in range(0, num_pairs, CHUNK):
        offsets = first + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offsets, mask=offsets < num_pairs, other=NUM_EXPERTS)
        counts += tl.histogram(ids, EXPERTS_PAD)
    counts = tl.where(bins < NUM_EXPERTS, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    tl.store(cursor_ptr + bins, ends - padded)
    for first_block in range(0, num_blocks, BLOCKS_CHUNK):
        blocks = first_block + tl.arange(0, BLOCKS_CHUNK)
        # Block b belongs to the first expert whose rows end after b's first row.
        is_past = ends[None, :] <= (blocks * BLOCK_M)[:, None]
        experts = tl.sum(is_past.to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, experts, mask=blocks < num_blocks)
    for first in range(0, max_padded, CHUNK):
        offsets = first + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offsets, num_pairs + 0 * offsets, mask=offsets < max_padded)
    tl.debug_barrier()  # the padding and cursors are written before any pair lands
    for first in range(0, num_pairs, CHUNK):
        offsets = first + tl.arange(0, CHUNK)
        is_pair = offsets < num_pairs
        ids = tl.load(ids_ptr + offsets, mask=is_pair, other=0)
        rows = tl.atomic_add(cursor_ptr + ids, 1, mask=is_pair)
        tl.store(sorted_ptr + rows, offsets, mask=is_pair)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids`` int32 ``[T, k]`` → ``(sorted_pairs, block_experts, num_padded)`` (the
    module table). Precondition: every id is in ``[0, num_experts)``."""
    num_pairs = topk_ids.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    num_blocks = triton.cdiv(max_padded, block_m)
    device = topk_ids.device
    experts_pad = triton.next_power_of_2(num_experts + 1)  # room for the padding bin
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursors = torch.empty(experts_pad, dtype=torch.int32, device=device)
    _align_kernel[(1,)](
        topk_ids, sorted_pairs, block_experts, num_padded, cursors,
        num_pairs, max_padded, num_blocks,
        NUM_EXPERTS=num_experts, EXPERTS_PAD=experts_pad, BLOCK_M=block_m, CHUNK=ALIGN_CHUNK,
        BLOCKS_CHUNK=BLOCKS_CHUNK, num_warps=8,
    )  # fmt: skip
    return sorted_pairs, block_experts, num_padded
