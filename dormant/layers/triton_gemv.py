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

At batch 1 the weight read can start before the kernel before it ends: ``pdl_linear`` launches
with programmatic dependent launch (``triton_pdl.py``). Each program loads its first
``[block_n, prefetch_k]`` of the weights, waits for ``x``'s kernel, then reads ``x`` from L2 and
streams the rest; the tiles (``pdl_tiles``) keep every program resident in one wave on 132 SMs,
so all the prefetches are in flight at once. An opted-in layer (``LinearBase.enable_pdl_gemv``)
takes it at one token when ``USE_PDL_AT_BATCH_1`` is set (read at each call; on by default: with
the other batch-1 PDL knobs, Qwen3-30B-A3B's 48-layer step went from 2.41 to 2.21 x its roofline,
2026-12-02e run 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dormant.layers.triton_pdl import is_pdl_available

SKINNY_MAX_TOKENS = 4  # the direct MoE path's batch sizes at top-8
_TARGET_PROGRAMS = 512
_ACCUMULATOR = 4096  # float32 elements per program: 32 registers a thread at 4 warps
# Opted-in layers run ``pdl_linear`` at one token on the GPU. On since the engine's GPU tests
# passed with it (2026-12-02f run 1); benchmarks/moe.py's knobs-off child turns it off.
USE_PDL_AT_BATCH_1 = True
# pdl_tiles' rule: about PDL_PROGRAMS programs of PDL_ACCUMULATOR float32 sums each. 1024 of
# 2048 (QKV 4 rows a program, O 2) since the sixteenth session: Qwen3-30B-A3B's batch-1 layer
# 56.8 -> 55.3 us against 256 of 4096 (16 and 8 rows; results/2026-12-04-run1-moe-b1-sweep.jsonl).
PDL_PROGRAMS = 1024
PDL_ACCUMULATOR = 2048


@dataclass(frozen=True)
class GemvTiles:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    prefetch_k: int = 0  # pdl_linear only: the depth each program loads before its wait


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


def pdl_tiles(n: int, k: int) -> GemvTiles:
    """About ``PDL_PROGRAMS`` programs (QKV 5120: 4 rows each, 1280 programs; O 2048: 2, 1024),
    a quarter of the depth prefetched (QKV 512 of 2048: 4 KB a program, about 40 KB an SM;
    O 1024 of 4096), the rest in steps that keep the accumulator at ``PDL_ACCUMULATOR`` (QKV
    512 deep, O 1024: 16 float32 a thread at 4 warps)."""
    rows = triton.cdiv(n, PDL_PROGRAMS)
    block_n = min(16, 1 << (rows.bit_length() - 1))
    depth = triton.next_power_of_2(k)
    block_k = max(16, min(1024, PDL_ACCUMULATOR // block_n, depth))
    return GemvTiles(block_n, block_k, prefetch_k=max(16, depth // 4))


def can_pdl_gemv(x: torch.Tensor) -> bool:
    """Whether an opted-in layer runs ``pdl_linear`` on ``x``: one token, on a device with PDL,
    ``USE_PDL_AT_BATCH_1`` set."""
    return x.shape[0] == 1 and USE_PDL_AT_BATCH_1 and is_pdl_available(x.device)


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


@triton.jit
def _pdl_gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PREFETCH_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    is_col = cols < N
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    kp = tl.arange(0, PREFETCH_K)
    is_kp = kp < K
    w_first = tl.load(w_rows + kp[None, :], mask=is_col[:, None] & is_kp[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=is_col, other=0.0).to(tl.float32)
    if USE_PDL:  # x is the previous kernel's; then the next kernel may launch (triton_pdl.py)
        gdc_wait()
        gdc_launch_dependents()
    x_first = tl.load(x_ptr + kp, mask=is_kp, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = tl.sum(w_first.to(tl.float32) * x_first[None, :], axis=1)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for first in range(PREFETCH_K, K, BLOCK_K):  # the rest of the depth, as _one_token
        is_k = ks < K - first
        x = tl.load(x_ptr + first + ks, mask=is_k, other=0.0, cache_modifier=".cg")
        w = tl.load(w_rows + first + ks[None, :], mask=is_col[:, None] & is_k[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y += tl.sum(acc, axis=1)
    if HAS_BIAS:  # added before the one rounding, as cuBLAS's bias epilogue does
        y += bias
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=is_col)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    depth, n = x.shape[1], weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != depth or weight.dtype != x.dtype:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} does not fit x {tuple(x.shape)} "
            f"{x.dtype}: it must be [out, {depth}] in {x.dtype}"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("the GEMV needs unit stride in the last dimension of x and weight")


def pdl_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: GemvTiles | None = None,
    *,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one token, ``x [1, K]``, with the weights prefetched
    before the wait on ``x``'s kernel: ``skinny_linear``'s operands and rounding (its sums in
    another order: within a unit in the last place of ``F.linear``). ``pdl`` False launches the
    same kernel plainly (the same bits); None or True: with PDL where the device has it.
    ``tiles`` overrides ``pdl_tiles``, for tuning. No host sync."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"pdl_linear takes one token, x [1, K]; got {tuple(x.shape)}")
    _check_operands(x, weight, bias)
    n, depth = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    tiles = tiles or pdl_tiles(n, depth)
    is_pdl = (pdl is None or pdl) and is_pdl_available(x.device)
    _pdl_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, weight if bias is None else bias, y, n, depth, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        PREFETCH_K=tiles.prefetch_k, USE_PDL=is_pdl, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, launch_pdl=is_pdl,
    )  # fmt: skip
    return y


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
    _check_operands(x, weight, bias)
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
