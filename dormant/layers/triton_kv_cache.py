"""Writes a step's keys and values into the paged KV cache: one Triton kernel, quantizing to
fp8 on the way when the cache is fp8 (``(x / scale)`` rounded to the cache dtype, as the
reference ``write_kv_cache`` does)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_kv, stride_cache_slot, HEAD_DIM: tl.constexpr, IS_FP8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_mapping_ptr + token)
    key = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + d)
    value = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + d)
    cache_dtype = cache_ptr.dtype.element_ty
    if IS_FP8:
        key = key.to(tl.float32) / tl.load(k_scale_ptr)
        value = value.to(tl.float32) / tl.load(v_scale_ptr)
    destination = cache_ptr + slot * stride_cache_slot + head * HEAD_DIM + d
    tl.store(destination, key.to(cache_dtype))
    tl.store(destination + stride_cache_kv, value.to(cache_dtype))


def write_kv_cache(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Same contract as ``dormant.layers.attention.write_kv_cache``. Preconditions besides:
    ``kv_cache`` is contiguous, ``key``/``value`` have unit stride in the last dimension, and
    ``head_dim`` is a power of two."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    is_fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    _write_kernel[(num_tokens, num_kv_heads)](
        key, value, kv_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), HEAD_DIM=head_dim, IS_FP8=is_fp8, num_warps=1,
    )  # fmt: skip
