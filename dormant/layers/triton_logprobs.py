"""The sampled token's logprob and rank in one read of the logits, as two Triton kernels.

``log_softmax`` then a gather, a rank count and a top-k read a ``[n, V]`` float32 row block
four times and write it once. Here the first kernel reads it once: each program takes one
segment of one row and keeps, per lane, a running maximum and a rescaled sum of exponentials
(the online softmax), and counts the values above the token's. The second kernel combines
the segments of a row into its log-normaliser ``lse``, and writes the packed row's first
three columns: the token, its rank and its logprob ``x[token] - lse``.

Against ``log_softmax`` (the reference, ``dormant.worker.logprobs``), values differ only in
the order of the float32 sum, so by a few units in the last place. Ranks count the values
strictly above the token's on the logits rather than on their logprobs, which is the same
order (the logprob is the logit less a constant) without the ties that rounding can make.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SEGMENT = 8192  # values of one row per program of the first kernel
_BLOCK = 1024  # values per iteration of its loop


@triton.jit
def _segment_stats_kernel(
    x_ptr, tokens_ptr, max_ptr, sum_ptr, count_ptr, vocab, stride_row, num_segments,
    SEGMENT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    segment = tl.program_id(1)
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    token_value = tl.load(row_ptr + tl.load(tokens_ptr + row)).to(tl.float32)
    running_max = tl.full([BLOCK], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK], tl.float32)
    above = tl.zeros([BLOCK], tl.int32)
    start = segment * SEGMENT
    for offset in range(0, SEGMENT, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, x)
        # A lane that has seen only -inf (masked, or filtered by the sampler) keeps sum 0.
        is_finite = new_max > float("-inf")
        safe_max = tl.where(is_finite, new_max, 0.0)
        rescaled = running_sum * tl.exp(running_max - safe_max) + tl.exp(x - safe_max)
        running_sum = tl.where(is_finite, rescaled, 0.0)
        running_max = new_max
        above += (x > token_value).to(tl.int32)
    segment_max = tl.max(running_max, axis=0)
    safe_segment_max = tl.where(segment_max > float("-inf"), segment_max, 0.0)
    weights = tl.where(running_max > float("-inf"), tl.exp(running_max - safe_segment_max), 0.0)
    out = row * num_segments + segment
    tl.store(max_ptr + out, segment_max)
    tl.store(sum_ptr + out, tl.sum(running_sum * weights, axis=0))
    tl.store(count_ptr + out, tl.sum(above, axis=0))


@triton.jit
def _combine_kernel(
    x_ptr, tokens_ptr, max_ptr, sum_ptr, count_ptr, packed_ptr, lse_ptr,
    stride_row, stride_packed, num_segments, SEGMENTS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    segments = tl.arange(0, SEGMENTS)
    mask = segments < num_segments
    at = row * num_segments + segments
    maxes = tl.load(max_ptr + at, mask=mask, other=float("-inf"))
    sums = tl.load(sum_ptr + at, mask=mask, other=0.0)
    row_max = tl.max(maxes, axis=0)  # finite: the sampled token's value is
    lse = row_max + tl.log(tl.sum(tl.where(mask, sums * tl.exp(maxes - row_max), 0.0), axis=0))
    rank = 1 + tl.sum(tl.load(count_ptr + at, mask=mask, other=0), axis=0)
    token = tl.load(tokens_ptr + row)
    value = tl.load(x_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32) - lse
    out = packed_ptr + row * stride_packed
    tl.store(out, token.to(tl.int32))
    tl.store(out + 1, rank)
    tl.store(out + 2, value.to(tl.int32, bitcast=True))
    tl.store(lse_ptr + row, lse)


def token_logprobs_and_ranks(
    logits: torch.Tensor, token_ids: torch.Tensor, packed: torch.Tensor
) -> torch.Tensor:
    """Writes columns 0..2 of ``packed`` (int32 [n, >= 3]): per row of ``logits`` (float32
    [n, V], unit stride in V), the token of ``token_ids`` (int [n]), its rank and its logprob
    (float32 bits). Returns each row's log-normaliser ``lse`` (float32 [n]), so that any
    value's logprob is ``logit - lse``. Never synchronizes with the host."""
    num_rows, vocab = logits.shape
    num_segments = triton.cdiv(vocab, _SEGMENT)
    stats = torch.empty((3, num_rows, num_segments), dtype=torch.float32, device=logits.device)
    counts = stats[2].view(torch.int32)
    lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    tokens = token_ids.reshape(-1)
    if num_rows == 0:
        return lse
    _segment_stats_kernel[(num_rows, num_segments)](
        logits, tokens, stats[0], stats[1], counts, vocab, logits.stride(0), num_segments,
        SEGMENT=_SEGMENT, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    _combine_kernel[(num_rows,)](
        logits, tokens, stats[0], stats[1], counts, packed, lse,
        logits.stride(0), packed.stride(0), num_segments,
        SEGMENTS=max(triton.next_power_of_2(num_segments), 2), num_warps=1,
    )  # fmt: skip
    return lse
