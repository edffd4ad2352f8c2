"""A skinny GEMM for decode sizes: ``y = x @ w.T (+ b)`` for ``x [M, K]`` with ``M <= 4``
(``skinny_linear``), bf16/fp16/fp32 in, float32 sums, one rounding to the input dtype.

Why: at batch 1 a projection is a weight read. cuBLAS's GEMVs of Qwen3-30B-A3B's attention ran
at about 2.0-2.7 TB/s on the H200 (QKV [5120, 2048], 21 MB: 7.8 us; O [2048, 4096], 16.8 MB:
6.9 us plus a 1.7 us split-K reduce; results/2026-12-01d-run1-profile-moe-b1.jsonl), where the
direct MoE kernels, built the same way as this one, stream expert weights at about 3.35 TB/s.
At that rate QKV takes about 6.3 us and O 5.0 us, one launch each: about 5 us a layer.

Each program owns ``block_n`` rows of ``w`` (output columns) over the whole depth K, for every
token, with multiply-adds in float32 (no ``tl.dot``: nothing pads a matrix core's 16 rows), and
one ``[tokens, block_n, block_k]`` accumulator summed at the end. Tiles (``gemv_tiles``): about
512 programs, 32 KB of weights each, so all are resident at once and every SM keeps its loads
in flight. The sums run in another order than cuBLAS's, so the output can differ from
``F.linear``'s by a unit in the last place: layers opt in (``LinearBase.enable_skinny_gemv``),
and the dense models do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SKINNY_MAX_TOKENS = 4  # the direct MoE path's batch sizes at top-8
_TARGET_PROGRAMS = 512
_ACCUMULATOR = 4096  # float32 elements per program: 32 registers a thread at 4 warps


@dataclass(frozen=True)
class GemvTiles:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def is_skinny(num_tokens: int) -> bool:
    """Whether an opted-in layer runs ``skinny_linear`` for a batch of ``num_tokens``."""
    return 0 < num_tokens <= SKINNY_MAX_TOKENS


def gemv_tiles(num_tokens: int, n: int, k: int) -> GemvTiles:
    """At least ``_TARGET_PROGRAMS`` programs where N allows (QKV 5120: 8 rows each, 640
    programs; O 2048: 4, 512), and the depth step that keeps the accumulator at
    ``_ACCUMULATOR`` elements (one token: K 2048 at 8 rows in steps of 512)."""
    rows = triton.cdiv(n, _TARGET_PROGRAMS)
    block_n = min(16, 1 << (rows.bit_length() - 1))  # the power of two at or below: >= 512
    tokens_pad = triton.next_power_of_2(num_tokens)
    block_k = _ACCUMULATOR // (tokens_pad * block_n)
    return GemvTiles(block_n, max(16, min(512, block_k, triton.next_power_of_2(k))))


@triton.jit
def _one_token(x_ptr, w_ptrs, is_col, ks, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # the direct MoE kernels' shape: a [BLOCK_N, BLOCK_K] accumulator, x broadcast over rows
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for first in range(0, K, BLOCK_K):
        is_k = ks < K - first
        x = tl.load(x_ptr + first + ks, mask=is_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=is_col[:, None] & is_k[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
    return tl.sum(acc, axis=1)[None, :]


@triton.jit
def _few_tokens(
    x_ptr, w_ptrs, is_col, ks, K, stride_x, NUM_TOKENS: tl.constexpr, TOKENS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # each weight tile loaded once for every token: a [TOKENS_PAD, BLOCK_N, BLOCK_K] accumulator
    tokens = tl.arange(0, TOKENS_PAD)
    x_ptrs = x_ptr + tokens[:, None].to(tl.int64) * stride_x + ks[None, :]
    acc = tl.zeros([TOKENS_PAD, BLOCK_N, BLOCK_K], tl.float32)
    for first in range(0, K, BLOCK_K):
        is_k = ks < K - first
        x = tl.load(x_ptrs, mask=(tokens < NUM_TOKENS)[:, None] & is_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=is_col[:, None] & is_k[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return tl.sum(acc, axis=2)


@triton.jit
def _skinny_gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_x, stride_w, stride_y,
    NUM_TOKENS: tl.constexpr, TOKENS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    if TOKENS_PAD == 1:
        y = _one_token(x_ptr, w_ptrs, is_col, ks, K, BLOCK_N, BLOCK_K)
    else:
        y = _few_tokens(
            x_ptr, w_ptrs, is_col, ks, K, stride_x, NUM_TOKENS, TOKENS_PAD, BLOCK_N, BLOCK_K
        )
    if HAS_BIAS:  # added before the one rounding, as cuBLAS's bias epilogue does
        y += tl.load(b_ptr + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
    tokens = tl.arange(0, TOKENS_PAD)
    y_ptrs = y_ptr + tokens[:, None].to(tl.int64) * stride_y + cols[None, :]
    mask = (tokens < NUM_TOKENS)[:, None] & is_col[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` (any M; meant for ``is_skinny``),
    ``weight [N, K]``, ``bias [N]`` or None, one dtype, unit stride in K → ``[M, N]``.
    ``tiles`` overrides ``gemv_tiles``, for tuning. No host sync."""
    num_tokens, depth = x.shape
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != depth or weight.dtype != x.dtype:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)} "
            f"{x.dtype}: it must be [out, {depth}] in {x.dtype}"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear needs unit stride in the last dimension of x and weight")
    y = torch.empty((num_tokens, n), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    tiles = tiles or gemv_tiles(num_tokens, n, depth)
    _skinny_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, weight if bias is None else bias, y, n, depth, x.stride(0), weight.stride(0),
        y.stride(0), NUM_TOKENS=num_tokens, TOKENS_PAD=triton.next_power_of_2(num_tokens),
        HAS_BIAS=bias is not None, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y
