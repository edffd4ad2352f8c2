"""Paged prefill attention in Triton: many new tokens per sequence over its paged KV cache.

Same semantics as ``paged_attention_reference``: each new token attends causally over its
sequence's cached prefix and the new tokens up to itself; bf16, fp16, fp32 or fp8 KV
(dequantized with the layer's k/v scales), GQA. It serves fresh prompts, chunked prefill over a
cached prefix and mixed batches (decode tokens included). No host sync, but the grid depends on
``meta.max_query_len`` (a host int), so it is not meant for graph capture. Checked against the
reference (tests/layers/test_triton_prefill.py).

One program per (sequence, tile of BLOCK_M new tokens, query head): flash attention over the
sequence's keys in tiles of BLOCK_N positions, each position's block looked up in the block
table (so a tile may span several KV blocks, and any block size works). A tile of queries only
visits the positions it can see: ``[0, min(seq_len, context_len + its last row + 1))``. Cache
entries past ``seq_lens`` are never read, so poisoned (NaN) or stale slots cannot leak in. Masked
lanes are clamped to position 0, so that the (unmasked) block-table gather of a tile past the
sequence's end stays inside the table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dormant.layers.context import AttentionMetadata
from dormant.layers.triton_paged import attend_tile

MAX_BLOCK_N = 64  # keys per tile
# K and V tiles of one pipeline stage stay within 64 KiB of shared memory (two stages fit in an
# H100/H200's 228 KiB with room for the dot operands), so fp32 caches with 256-wide heads halve
# BLOCK_N.
STAGE_BYTES = 64 * 1024


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr, k_scale_ptr,
    v_scale_ptr, sm_scale,
    stride_q_token, stride_q_head, stride_block, stride_slot, stride_kv_head, stride_table,
    stride_o_token, stride_o_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:  # the grid is sized for the batch's longest query
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    kv_head = head // GROUP
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    tokens = (q_start + tl.where(row_mask, rows, 0)).to(tl.int64)
    query_pos = context_len + rows  # [BLOCK_M]
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    q_offsets = tokens[:, None] * stride_q_token + head * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    k_scale = tl.load(k_scale_ptr) if IS_FP8 else 1.0
    v_scale = tl.load(v_scale_ptr) if IS_FP8 else 1.0

    # Position 0 is visible to every row, so after the first tile every row's max is finite and
    # fully masked later tiles contribute exp(-inf) = 0 rather than NaN.
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_end = tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_M)
    for start in range(0, kv_end, BLOCK_N):
        pos = start + n
        valid = pos < seq_len
        safe_pos = tl.where(valid, pos, 0)  # masked lanes address slot 0 of the first block
        is_visible = valid[None, :] & (pos[None, :] <= query_pos[:, None])  # causal
        m, denom, acc = attend_tile(
            q, m, denom, acc, k_ptr, v_ptr, tables_ptr + seq * stride_table, safe_pos, valid,
            is_visible, kv_head, d, k_scale, v_scale, sm_scale, stride_block, stride_slot,
            stride_kv_head, BLOCK_SIZE, IS_FP8, DOT_PRECISION,
        )  # fmt: skip
    out = acc / denom[:, None]
    o_offsets = tokens[:, None] * stride_o_token + head * stride_o_head + d[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> torch.Tensor:
    """``query`` ``[num_tokens, num_heads, head_dim]`` → same shape and dtype.

    The contract of ``paged_attention_reference``: token layout per ``meta`` (see
    ``dormant.layers.context``), causal over the cached prefix and the new tokens, query head h
    reads kv head ``h // (num_heads // num_kv_heads)``, fp8 entries read as
    ``stored.float() * scale``, entries at positions ``>= seq_lens[s]`` never read.
    Preconditions: ``num_tokens == query_start_loc[-1]``; ``head_dim`` a power of two, at least
    16; the last dimension of ``query`` and ``kv_cache`` contiguous. Any block size.
    """
    _, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(
            f"paged_prefill_attention needs head_dim a power of two >= 16, got {head_dim}; "
            "use paged_attention_reference for this model"
        )
    group = num_heads // num_kv_heads
    block_m = max(16, min(64, triton.next_power_of_2(meta.max_query_len)))
    block_n = max(16, min(MAX_BLOCK_N, STAGE_BYTES // (2 * head_dim * kv_cache.element_size())))
    out = torch.empty_like(query)
    keys, values = kv_cache[0], kv_cache[1]
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        query, keys, values, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
        k_scale, v_scale, scale,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        IS_FP8=kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=4,
        num_stages=2,
    )  # fmt: skip
    return out
