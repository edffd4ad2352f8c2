"""Writes a step's keys and values into the paged KV cache: one Triton kernel, quantizing to
fp8 on the way when the cache is fp8 (``(x / scale)`` rounded to the cache dtype, as the
reference ``write_kv_cache`` does).

At batch 1 (one token) the kernel can launch with programmatic dependent launch
(``USE_PDL_AT_BATCH_1``, ``triton_pdl.py``): before its wait it loads the slot (a step input)
and the scales; after it, the key and value the rotary kernel finished, from L2. Off by default
until ``benchmarks/moe_b1_sweep.py --only layer`` measures it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dormant.layers.triton_pdl import pdl_for

# One token only (a batch-1 decode step): launch with PDL (triton_pdl.py). On since the engine's
# GPU tests passed with it (2026-12-02f run 1); benchmarks/moe.py's knobs-off child turns it off.
USE_PDL_AT_BATCH_1 = True
# Every other launch (more than one row: larger decode batches, prefill) with PDL too. Off: in
# benchmarks/dense_decode_sweep.py on the H200 it saved under 1 % of the dense layer at batch
# 64-256 (results/2026-12-03-run2-dense-sweep.jsonl).
USE_PDL_ABOVE_BATCH_1 = False


@triton.jit
def _write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_kv, stride_cache_slot, HEAD_DIM: tl.constexpr, IS_FP8: tl.constexpr,
    USE_PDL: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_mapping_ptr + token)  # a step input: no kernel of the layer writes it
    k_scale = tl.load(k_scale_ptr) if IS_FP8 else 1.0
    v_scale = tl.load(v_scale_ptr) if IS_FP8 else 1.0
    if USE_PDL:  # the key is the rotary kernel's; then the attention may launch
        gdc_wait()
        gdc_launch_dependents()
    key = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + d,
                  cache_modifier=CACHE)  # fmt: skip
    value = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + d,
                    cache_modifier=CACHE)  # fmt: skip
    cache_dtype = cache_ptr.dtype.element_ty
    if IS_FP8:
        key = key.to(tl.float32) / k_scale
        value = value.to(tl.float32) / v_scale
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
    *,
    pdl: bool | None = None,
) -> None:
    """Same contract as ``dormant.layers.attention.write_kv_cache``. Preconditions besides:
    ``kv_cache`` is contiguous, ``key``/``value`` have unit stride in the last dimension, and
    ``head_dim`` is a power of two. ``pdl`` overrides the PDL knobs (``triton_pdl.pdl_for``;
    off where the device has no PDL), for tuning."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    is_fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    is_pdl = pdl_for(num_tokens, pdl, USE_PDL_AT_BATCH_1, USE_PDL_ABOVE_BATCH_1, key.device)
    _write_kernel[(num_tokens, num_kv_heads)](
        key, value, kv_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), HEAD_DIM=head_dim, IS_FP8=is_fp8,
        USE_PDL=is_pdl, CACHE=".cg" if is_pdl else "",  # from L2 after the wait
        num_warps=1, launch_pdl=is_pdl,
    )  # fmt: skip
