"""The loop body shared by the paged attention kernels: one tile of keys and values, read
through the block table and folded into a flash-attention running state."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q, m, denom, acc, k_ptr, v_ptr, table_row_ptr, safe_pos, valid, visible, kv_head, d,
    k_scale, v_scale, sm_scale, stride_block, stride_slot, stride_kv_head,
    BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Folds the tile at positions ``safe_pos`` ([BLOCK_N]) into ``(m, denom, acc)``: the
    running max and sum of each query row ([rows]) and its unnormalised output ([rows, d]).

    ``table_row_ptr`` points at the sequence's row of the block table. ``valid`` masks the K/V
    loads (lanes past the keys to read; their ``safe_pos`` must still be a position the sequence
    owns, so the table lookup stays in bounds) and ``visible`` ([rows, BLOCK_N]) the scores.
    Precondition: every row sees at least one key in this tile or already has a finite max.
    fp8 keys and values are dequantized to the query dtype before the products.
    """
    dot_dtype = q.dtype
    block = tl.load(table_row_ptr + safe_pos // BLOCK_SIZE).to(tl.int64)
    offsets = (block[:, None] * stride_block + (safe_pos % BLOCK_SIZE)[:, None] * stride_slot
               + kv_head * stride_kv_head + d[None, :])  # fmt: skip
    k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
    if IS_FP8:
        k = (k.to(tl.float32) * k_scale).to(dot_dtype)
    scores = tl.dot(q, tl.trans(k.to(dot_dtype)), input_precision=DOT_PRECISION) * sm_scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    correction = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    denom = denom * correction + tl.sum(p, axis=1)
    v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)
    if IS_FP8:
        v = (v.to(tl.float32) * v_scale).to(dot_dtype)
    pv = tl.dot(p.to(dot_dtype), v.to(dot_dtype), input_precision=DOT_PRECISION)
    return m_new, denom, acc * correction[:, None] + pv
