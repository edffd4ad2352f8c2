"""The sampled token's logprob and rank, and the top-k, in one read of the logits, as two
Triton kernels.

``log_softmax`` then a gather, a rank count and ``topk`` read a ``[n, V]`` float32 row block
four times and write it once, and ``topk`` over a 151936-wide row is slow (one pass per radix
digit). Here the first kernel reads it once: each program holds one segment of one row in
registers, takes its maximum and its sum of exponentials, counts the values above the token's,
and picks the segment's ``k`` best by ``k`` rounds of argmax. The second kernel combines the
segments of a row into its log-normaliser ``lse`` and writes the packed row's first three
columns: the token, its rank and its logprob ``x[token] - lse``; the top-k of the candidates
(``k`` per segment, so ``k`` per row are among them) is then a small ``topk``.

Candidates are compared as order-preserving int32 keys of their float32 values, with taken and
padding positions below every value, ``-inf`` included: a row always yields ``k`` distinct
tokens, as ``torch.topk`` does, even where the sampler left fewer than ``k`` finite logits.

Against ``log_softmax`` (the reference, ``dormant.worker.logprobs``), values differ only in
the order of the float32 sum, so by a few units in the last place. Ranks count the values
strictly above the token's on the logits rather than on their logprobs, which is the same
order (the logprob is the logit less a constant) without the ties that rounding can make.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SEGMENT = 8192  # values of one row per program of the first kernel, held in registers
MAX_FUSED_TOP = 32  # larger top-k requests use torch.topk on the logits
_LOW_BITS = 0x7FFFFFFF  # flipped in a negative float's bits to order them as the floats
_KEY_FLOOR: tl.constexpr = tl.constexpr(-(2**31))  # below every value's key, -inf's included


@triton.jit
def _segment_stats_kernel(
    x_ptr, tokens_ptr, max_ptr, sum_ptr, count_ptr, top_key_ptr, top_id_ptr, live_top_ptr,
    vocab, stride_row, num_segments, SEGMENT: tl.constexpr, NUM_TOP: tl.constexpr,
    HAS_LIVE_TOP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    segment = tl.program_id(1)
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    token_value = tl.load(row_ptr + tl.load(tokens_ptr + row)).to(tl.float32)
    offsets = tl.arange(0, SEGMENT)
    cols = segment * SEGMENT + offsets
    is_column = cols < vocab
    x = tl.load(row_ptr + cols, mask=is_column, other=float("-inf")).to(tl.float32)
    segment_max = tl.max(x, axis=0)
    safe_max = tl.where(segment_max > float("-inf"), segment_max, 0.0)  # an all -inf segment
    out = row * num_segments + segment
    tl.store(max_ptr + out, segment_max)
    tl.store(sum_ptr + out, tl.sum(tl.exp(x - safe_max), axis=0))
    tl.store(count_ptr + out, tl.sum((x > token_value).to(tl.int32), axis=0))
    if NUM_TOP > 0:
        live = NUM_TOP
        if HAS_LIVE_TOP:  # a graph's batch asks for fewer: the rest are below every candidate
            live = tl.load(live_top_ptr)
        bits = x.to(tl.int32, bitcast=True)
        keys = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        keys = tl.where(is_column, keys, _KEY_FLOOR)
        for i in tl.static_range(NUM_TOP):
            if i < live:
                best = tl.argmax(keys, axis=0)
                tl.store(top_key_ptr + out * NUM_TOP + i, tl.max(keys, axis=0))
                tl.store(top_id_ptr + out * NUM_TOP + i, segment * SEGMENT + best)
                keys = tl.where(offsets == best, _KEY_FLOOR, keys)
            else:
                tl.store(top_key_ptr + out * NUM_TOP + i, _KEY_FLOOR)
                tl.store(top_id_ptr + out * NUM_TOP + i, 0)


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


def fused_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: int,
    packed: torch.Tensor,
    *,
    segment: int = _SEGMENT,
    num_warps: int = 8,
    live_top: torch.Tensor | None = None,
) -> None:
    """Fills ``packed`` (int32 [n, 3 + 2 * num_top], ``gather_logprobs``'s layout) with the
    logprobs of ``logits`` (float32 [n, V], unit stride in V) for ``token_ids`` (int [n]):
    each token, its rank and logprob, then the ``num_top`` best tokens and their logprobs.
    Preconditions: ``num_top <= min(MAX_FUSED_TOP, V)``. Never synchronizes with the host.
    ``segment`` (a power of two) and ``num_warps`` shape the first kernel's programs
    (``benchmarks/logprobs_kernel.py`` sweeps them). ``live_top`` (int32 [1] on the device, at
    most ``num_top``): only that many top tokens are computed, read at run time, so a graph
    captured for ``num_top`` pays for what its batch asks; the rest of the top columns are
    then undefined."""
    num_rows, vocab = logits.shape
    if num_rows == 0:
        return
    num_segments = triton.cdiv(vocab, segment)
    device = logits.device
    stats = torch.empty((3, num_rows, num_segments), dtype=torch.float32, device=device)
    counts = stats[2].view(torch.int32)
    candidates = torch.empty(
        (2, num_rows, num_segments * max(num_top, 1)), dtype=torch.int32, device=device
    )
    lse = torch.empty(num_rows, dtype=torch.float32, device=device)
    tokens = token_ids.reshape(-1)
    _segment_stats_kernel[(num_rows, num_segments)](
        logits, tokens, stats[0], stats[1], counts, candidates[0], candidates[1],
        tokens if live_top is None else live_top, vocab, logits.stride(0), num_segments,
        SEGMENT=segment, NUM_TOP=num_top, HAS_LIVE_TOP=live_top is not None,
        num_warps=num_warps,
    )  # fmt: skip
    _combine_kernel[(num_rows,)](
        logits, tokens, stats[0], stats[1], counts, packed, lse,
        logits.stride(0), packed.stride(0), num_segments,
        SEGMENTS=max(triton.next_power_of_2(num_segments), 2), num_warps=1,
    )  # fmt: skip
    if num_top > 0:
        top_keys, at = candidates[0].topk(num_top, dim=-1)
        bits = torch.where(top_keys < 0, top_keys ^ _LOW_BITS, top_keys)
        first_value = 3 + num_top
        packed[:, 3:first_value] = candidates[1].gather(-1, at)
        packed[:, first_value:] = bits.view(torch.float32).sub_(lse[:, None]).view(torch.int32)
