"""The sampler's unfiltered draw (``dormant.worker.sampler``) in one Triton kernel.

The sampler picks a random row's token as ``argmax_v(p_v / E_v)``: ``p`` the unnormalised
probabilities ``exp(logits / T - max)``, ``E_v`` Exp(1) noise hashed from the row's keys and
``v``. In torch that is about twenty full passes over an ``[n, V]`` block, most of them over
int64 temporaries of the hash: at batch 512 and a 151936-token vocabulary about 20 GB of
memory traffic per decode step, some 6 ms on an H200. Here each program takes one segment of
one row, hashes the noise in registers, and keeps only the segment's best value and its
column; a small argmax over the segments picks the row's token. The logits are read twice (the
row maximum, then the draw), nothing of ``[n, V]`` is written.

The arithmetic is the reference's, operation for operation, with the same rounding: IEEE
division (``div_rn``), CUDA's ``expf`` and ``logf`` (libdevice, which torch's kernels call
too), the hash in exact integer arithmetic, and the first column among equal values winning,
as ``torch.argmax`` picks. So a row's token is bitwise the reference's, and the graph and
eager paths, the CPU and the GPU sample the same tokens for the same logits. The row maximum of
``logits / T`` is ``max(logits) / T``: correctly rounded division by a positive ``T`` keeps the
order.

Greedy rows take the argmax of their logits in the same pass (no noise).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Triton's interpreter (the CPU tests) has no libdevice: its exp and log are numpy's there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_SEGMENT = 8192  # columns of one row per program
_BLOCK = 1024  # columns per iteration inside a segment (the hash's int64 temporaries)
_MASK_32: tl.constexpr = tl.constexpr(0xFFFFFFFF)
# dormant.worker.sampler's _MIX_MULTIPLIERS and _NUM_UNIFORM_BITS (the tests check them)
_MIX_1: tl.constexpr = tl.constexpr(0x21F0AAAD)
_MIX_2: tl.constexpr = tl.constexpr(0x735A2D97)
_UNIFORM_BITS: tl.constexpr = tl.constexpr(23)
_UNIFORM_SCALE: tl.constexpr = tl.constexpr(2.0**-23)  # exact in float32


@triton.jit
def _mix32(x):
    """``sampler._mix32``: the lowbias32 bijection of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX_1) & _MASK_32
    x = x ^ (x >> 15)
    x = (x * _MIX_2) & _MASK_32
    return x ^ (x >> 15)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    return tl.log(x)


# One compiled kernel for every batch: the per-row vectors are views of a packed step buffer
# (``sampler.SamplingTensors``) whose offsets, like ``stride_keys`` (the batch size), change
# from step to step, and a specialisation on their alignment or value would recompile the
# kernel (about 0.4 s) at the first step of each new shape. Their loads are scalar per row, so
# the specialisation would gain nothing.
_PER_ROW = ["row_max_ptr", "temperatures_ptr", "greedy_ptr", "keys_ptr", "best_ptr", "column_ptr"]


@triton.jit(do_not_specialize=["stride_keys"], do_not_specialize_on_alignment=_PER_ROW)
def _race_kernel(
    logits_ptr, row_max_ptr, temperatures_ptr, greedy_ptr, keys_ptr, best_ptr, column_ptr,
    vocab, stride_row, stride_keys, num_segments,
    SEGMENT: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    segment = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    is_greedy = tl.load(greedy_ptr + row) != 0
    temperature = tl.load(temperatures_ptr + row)
    scaled_max = tl.math.div_rn(tl.load(row_max_ptr + row), temperature)
    key_0 = tl.load(keys_ptr + row)
    key_1 = tl.load(keys_ptr + stride_keys + row)
    offsets = tl.arange(0, BLOCK)
    best = float("-inf")
    best_column = segment * SEGMENT
    for block in range(0, SEGMENT, BLOCK):
        start = segment * SEGMENT + block
        columns = start + offsets
        is_column = columns < vocab
        x = tl.load(row_ptr + columns, mask=is_column, other=float("-inf"))
        if is_greedy:
            values = x
        else:
            probs = _exp(tl.math.div_rn(x, temperature) - scaled_max, LIBDEVICE)
            bits = (_mix32(columns.to(tl.int64)) ^ key_0) + key_1
            bits = _mix32(bits & _MASK_32) >> (32 - _UNIFORM_BITS)
            uniform = (bits.to(tl.float32) + 0.5) * _UNIFORM_SCALE
            values = tl.math.div_rn(probs, -_log(uniform, LIBDEVICE))
            values = tl.where(is_column, values, -1.0)  # below every draw (they are >= 0)
        block_best = tl.max(values, axis=0)
        block_column = start + tl.argmax(values, axis=0, tie_break_left=True)
        is_better = block_best > best  # strict: an earlier block keeps a tie
        best_column = tl.where(is_better, block_column, best_column)
        best = tl.where(is_better, block_best, best)
    out = row * num_segments + segment
    tl.store(best_ptr + out, best)
    tl.store(column_ptr + out, best_column.to(tl.int64))


def fused_race(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    noise_keys: torch.Tensor,
    is_greedy: torch.Tensor,
) -> torch.Tensor:
    """The sampler's tokens (int64 [n]) for unfiltered rows: ``argmax(logits)`` on greedy rows,
    ``argmax(exp(logits / T - max) / E)`` on the others, ``E`` the Exp(1) noise of
    ``noise_keys`` (int64 [2, n]). ``logits``: float32 [n, V], unit stride in V;
    ``temperatures`` float32 [n] (1.0 on greedy rows); ``is_greedy`` bool [n]. Never
    synchronizes with the host (CUDA graphs capture it)."""
    return race_winners(logits, temperatures, noise_keys, is_greedy)[1]


def race_winners(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    noise_keys: torch.Tensor,
    is_greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_race``'s winning values (float32 [n]: the largest logit of a greedy row, the
    largest ``p / E`` of the others) and their columns (int64 [n])."""
    num_rows, vocab = logits.shape
    num_segments = triton.cdiv(vocab, _SEGMENT)
    device = logits.device
    best = torch.empty((num_rows, num_segments), dtype=torch.float32, device=device)
    columns = torch.empty((num_rows, num_segments), dtype=torch.int64, device=device)
    if num_rows == 0:
        return best[:, 0], columns[:, 0]
    row_max = logits.amax(dim=-1)
    _race_kernel[(num_rows, num_segments)](
        logits, row_max, temperatures, is_greedy.view(torch.uint8), noise_keys, best, columns,
        vocab, logits.stride(0), noise_keys.stride(0), num_segments,
        SEGMENT=_SEGMENT, BLOCK=_BLOCK, LIBDEVICE=not _INTERPRETED,
    )  # fmt: skip
    winner = best.argmax(dim=-1, keepdim=True)  # the first segment among equal bests
    return best.gather(-1, winner).squeeze(-1), columns.gather(-1, winner).squeeze(-1)
