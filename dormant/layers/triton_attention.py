"""Paged decode attention in Triton: one new token per sequence over its paged KV cache.

Graph-capturable (no host sync; the loop bound is read from ``seq_lens`` on the device), bf16,
fp16, fp32 or fp8 KV (dequantized with the layer's k/v scales), GQA. Checked against
``paged_attention_reference`` (tests/layers/test_triton_attention.py).

One program per (sequence, kv head): it loads its group of query heads once (padded to 16 rows
for the tensor cores), then streams the sequence's KV blocks with an online softmax, both
products on the tensor cores (``tl.dot``). (A first version multiplied with broadcasts on the
CUDA cores; with it, batch-1 decode of an 8B model ran at 3x the HBM roofline.) Cache entries
past ``seq_lens`` are never read, so poisoned (NaN) or stale slots cannot leak into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dormant.layers.context import AttentionMetadata


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, k_scale_ptr, v_scale_ptr, sm_scale,
    stride_q_seq, stride_q_head, stride_block, stride_slot, stride_kv_head, stride_table,
    stride_o_seq, stride_o_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    q_offsets = seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    dot_dtype = q.dtype
    k_scale = tl.load(k_scale_ptr) if IS_FP8 else 1.0
    v_scale = tl.load(v_scale_ptr) if IS_FP8 else 1.0

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for b in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_table + b).to(tl.int64)
        valid = b * BLOCK_SIZE + t < seq_len
        kv_offsets = (block * stride_block + t[:, None] * stride_slot + kv_head * stride_kv_head
                      + d[None, :])  # fmt: skip
        k = tl.load(k_ptr + kv_offsets, mask=valid[:, None], other=0.0)
        if IS_FP8:
            k = (k.to(tl.float32) * k_scale).to(dot_dtype)
        scores = tl.dot(q, tl.trans(k.to(dot_dtype)), input_precision=DOT_PRECISION) * sm_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))  # [GROUP_PAD, BLOCK_SIZE]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        correction = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * correction + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_offsets, mask=valid[:, None], other=0.0)
        if IS_FP8:
            v = (v.to(tl.float32) * v_scale).to(dot_dtype)
        pv = tl.dot(p.to(dot_dtype), v.to(dot_dtype), input_precision=DOT_PRECISION)
        acc = acc * correction[:, None] + pv
        m = m_new
    out = acc / denom[:, None]
    o_offsets = seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> torch.Tensor:
    """``query`` ``[num_seqs, num_heads, head_dim]`` (one token per sequence) → same shape.

    Preconditions: decode (``meta.max_query_len == 1``), ``head_dim`` a power of two,
    ``block_size`` at least 16.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    keys, values = kv_cache[0], kv_cache[1]
    _decode_kernel[(num_seqs, num_kv_heads)](
        query, keys, values, meta.block_tables, meta.seq_lens, out, k_scale, v_scale, scale,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 16), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, IS_FP8=kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=4,
        num_stages=2,
    )  # fmt: skip
    return out
