"""Rotary embedding of q and k, with Qwen3's per-head RMSNorm before it, as one Triton kernel
that rewrites the q and k heads of the fused qkv projection in place.

Rounds where the reference does (``RMSNorm`` then ``RotaryEmbedding``): the normalised head is
rounded to the model dtype, scaled by the norm weight and rounded, then rotated in float32 and
rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, eps,
    stride_token, stride_cos_sin, NUM_Q_HEADS: tl.constexpr,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads: they are adjacent in a qkv row
    d = tl.arange(0, HALF)
    base = qkv_ptr + token * stride_token + head * 2 * HALF
    x1 = tl.load(base + d)
    x2 = tl.load(base + HALF + d)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        if head < NUM_Q_HEADS:  # noqa: SIM108 (a runtime condition: Triton needs the branch)
            weight_ptr = q_weight_ptr
        else:
            weight_ptr = k_weight_ptr
        variance = (tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * HALF)
        inverse = tl.rsqrt(variance + eps)
        w1 = tl.load(weight_ptr + d).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + d).to(tl.float32)
        a = (w1 * (a * inverse).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        b = (w2 * (b * inverse).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + d)
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF + d)
    tl.store(base + d, (a * cos - b * sin).to(x1.dtype))
    tl.store(base + HALF + d, (b * cos + a * sin).to(x1.dtype))


def rotate_qk_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Rotates the q and k heads of ``qkv`` in place.

    ``qkv`` is ``[num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]`` with unit stride in
    the last dimension; ``positions`` int64 ``[num_tokens]``; ``cos_sin_cache`` float32
    ``[max_position, head_dim]`` as ``RotaryEmbedding`` builds it. ``norm`` is
    ``(q_weight, k_weight, eps)`` to RMS-normalise each head first. The v heads are untouched.
    Precondition: ``head_dim`` is a power of two.
    """
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    q_weight, k_weight, eps = norm if norm is not None else (qkv, qkv, 0.0)
    _rotate_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        qkv, positions, cos_sin_cache, q_weight, k_weight, eps, qkv.stride(0),
        cos_sin_cache.stride(0), NUM_Q_HEADS=num_q_heads, HALF=head_dim // 2,
        HAS_NORM=norm is not None, num_warps=1,
    )  # fmt: skip
