"""Rotary embedding of q and k, with Qwen3's per-head RMSNorm before it, as one Triton kernel
that rewrites the q and k heads of the fused qkv projection in place.

One program per (token, group of ``HEADS_PER_PROGRAM`` heads): a program per head, of 128
values, was latency-bound (13.7 µs per layer at batch 512 on an H200, 0.8 TB/s).

Rounds where the reference does (``RMSNorm`` then ``RotaryEmbedding``): the normalised head is
rounded to the model dtype, scaled by the norm weight and rounded, then rotated in float32 and
rounded once more.

At batch 1 (one token) the kernel can launch with programmatic dependent launch
(``USE_PDL_AT_BATCH_1``, ``triton_pdl.py``): before its wait it loads the norm weights, the
token's position and its cos/sin row (the position is a step input, written before the layers
run, never by the QKV projection before this kernel); after it, the heads, from L2. Off by
default until ``benchmarks/moe_b1_sweep.py --only layer`` measures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dormant.layers.triton_pdl import pdl_for

HEADS_PER_PROGRAM = 8  # one program rotates this many heads of one token
# One token only (a batch-1 decode step): launch with PDL (triton_pdl.py). On since the engine's
# GPU tests passed with it (2026-12-02f run 1); benchmarks/moe.py's knobs-off child turns it off.
USE_PDL_AT_BATCH_1 = True
# Every other launch (more than one row: larger decode batches, prefill) with PDL too. Off: in
# benchmarks/dense_decode_sweep.py on the H200 it saved under 1 % of the dense layer at batch
# 64-256 (results/2026-12-03-run2-dense-sweep.jsonl).
USE_PDL_ABOVE_BATCH_1 = False


@triton.jit
def _rotate_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, eps,
    stride_token, stride_cos_sin, NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr,
    CACHE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    # q heads, then k heads: they are adjacent in a qkv row
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    is_head = (heads < NUM_HEADS)[:, None]
    d = tl.arange(0, HALF)[None, :]
    # what no kernel of the layer writes first: the weights, the position and its cos/sin row
    if HAS_NORM:
        is_q = (heads < NUM_Q_HEADS)[:, None]
        q1 = tl.load(q_weight_ptr + d).to(tl.float32)
        q2 = tl.load(q_weight_ptr + HALF + d).to(tl.float32)
        k1 = tl.load(k_weight_ptr + d).to(tl.float32)
        k2 = tl.load(k_weight_ptr + HALF + d).to(tl.float32)
        w1 = tl.where(is_q, q1, k1)
        w2 = tl.where(is_q, q2, k2)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + d)
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF + d)
    if USE_PDL:  # the heads are the QKV projection's; then the KV write may launch
        gdc_wait()
        gdc_launch_dependents()
    first = qkv_ptr + token.to(tl.int64) * stride_token + heads[:, None] * (2 * HALF) + d
    x1 = tl.load(first, mask=is_head, other=0.0, cache_modifier=CACHE)  # [HEADS, HALF]
    x2 = tl.load(first + HALF, mask=is_head, other=0.0, cache_modifier=CACHE)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        variance = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF)
        inverse = tl.rsqrt(variance + eps)[:, None]
        a = (w1 * (a * inverse).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        b = (w2 * (b * inverse).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=is_head)
    tl.store(first + HALF, (b * cos + a * sin).to(x1.dtype), mask=is_head)


def rotate_qk_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    *,
    pdl: bool | None = None,
) -> None:
    """Rotates the q and k heads of ``qkv`` in place.

    ``qkv`` is ``[num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]`` with unit stride in
    the last dimension; ``positions`` int64 ``[num_tokens]``; ``cos_sin_cache`` float32
    ``[max_position, head_dim]`` as ``RotaryEmbedding`` builds it. ``norm`` is
    ``(q_weight, k_weight, eps)`` to RMS-normalise each head first. The v heads are untouched.
    Precondition: ``head_dim`` is a power of two. ``pdl`` overrides the PDL knobs
    (``triton_pdl.pdl_for``; off where the device has no PDL), for tuning.
    """
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    q_weight, k_weight, eps = norm if norm is not None else (qkv, qkv, 0.0)
    num_heads = num_q_heads + num_kv_heads
    heads = min(HEADS_PER_PROGRAM, triton.next_power_of_2(num_heads))
    is_pdl = pdl_for(num_tokens, pdl, USE_PDL_AT_BATCH_1, USE_PDL_ABOVE_BATCH_1, qkv.device)
    _rotate_kernel[(num_tokens, triton.cdiv(num_heads, heads))](
        qkv, positions, cos_sin_cache, q_weight, k_weight, eps, qkv.stride(0),
        cos_sin_cache.stride(0), NUM_Q_HEADS=num_q_heads, NUM_HEADS=num_heads, HEADS=heads,
        HALF=head_dim // 2, HAS_NORM=norm is not None, USE_PDL=is_pdl,
        CACHE=".cg" if is_pdl else "",  # from L2 after the wait: this SM's L1 may be stale
        num_warps=4, launch_pdl=is_pdl,
    )  # fmt: skip
