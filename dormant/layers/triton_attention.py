"""Paged decode attention in Triton: one new token per sequence over its paged KV cache.

Graph-capturable (no host sync; how far each program reads comes from ``seq_lens`` on the
device), bf16, fp16, fp32 or fp8 KV (dequantized with the layer's k/v scales), GQA. Checked
against ``paged_attention_reference`` (tests/layers/test_triton_attention.py).

Split-KV ("flash decoding"), in two kernels:

1. One program per (sequence, kv head, split of the context): it loads its group of query
   heads once (padded to 16 rows for the tensor cores) and streams its split's keys and values
   in tiles of ``BLOCK_N`` positions, each position's KV block looked up in the block table, with
   an online softmax; it writes its normalised partial output and log-sum-exp. Splits that start
   past the sequence's end write a log-sum-exp of -inf and stop.
2. The splits are merged, each weighted by its share of the softmax mass: by the last split
   program of each (sequence, kv head) to finish, given the layer's merge tickets (``tickets``,
   ``attention.new_merge_tickets``: no kernel of its own, no launch); otherwise by a second
   kernel, one program per (sequence, kv head). Both run ``_merge_group``: the same bits.

The tickets are int32 counters, one per (sequence, kv head), zero between launches: every split
program stores its partial, then (a CTA barrier, so every thread's stores are out) draws a
ticket with ``atomic_add``, acq_rel at GPU scope; the one that draws ``NUM_SPLITS - 1`` reads
the others' partials from L2 and writes the output, then sets the counter back to 0 (every
other program has drawn), so no memset is needed and a graph replays as is. They are the
layer's persistent state (a ``runtime`` buffer of ``PagedAttention``, restored bit-exact by
every sleep level). Precondition: two launches with one layer's tickets never run at once (one
stream per model). A batch with more (sequence, kv head) pairs than tickets, which
``plan_splits`` never splits, takes the merge kernel.

The split count depends only on the batch size and ``max_seq_len`` (host ints, fixed for a
captured graph), so a graph replays for any context length (``plan_splits``). Splits are for
parallelism: without them a batch-1 step of an 8B model had 8 programs for 132 SMs and attention
took a quarter of the step (41 µs per layer at 512 tokens). They cost traffic: every non-empty
split writes a float32 partial output per query head, which the merge reads back, 4 KiB per
(sequence, kv head, split) at a group of 4 and head_dim 128, against 32 KiB of bf16 KV in a
64-position split. So a batch that fills the GPU by itself takes fewer splits, and one split
writes its output directly, with no merge: at batch 512 the 32 splits of 64 positions cost 12 %
more traffic and a merge of 1.9 ms per step (H200, ``benchmarks/decode_profile.py``).
Cache entries past ``seq_lens`` are never read, so poisoned (NaN) or stale slots cannot leak
into the output.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dormant.layers.context import AttentionMetadata
from dormant.layers.triton_paged import attend_tile
from dormant.layers.triton_pdl import pdl_for

BLOCK_N = 64  # positions per tile
MAX_NUM_SPLITS = 32
# Split programs a launch aims at, per SM: a batch with this many (sequence, kv head) pairs per
# SM is not split at all.
PROGRAMS_PER_SM = 8

# Batch 1 only: launch both kernels with programmatic dependent launch (triton_pdl.py), so each
# launch hides behind the kernel before it. Measured by benchmarks/moe_b1_sweep.py on the H200:
# the KV write + decode attention of one layer, graph replay, 7.8 -> 7.0 us, bit-exact
# (results/2026-12-02d-run3-moe-b1-sweep.jsonl).
USE_PDL_AT_BATCH_1 = True
# Every other launch (more than one row: larger decode batches, prefill) with PDL too. Off: in
# benchmarks/dense_decode_sweep.py on the H200 it saved under 1 % of the dense layer at batch
# 64-256 (results/2026-12-03-run2-dense-sweep.jsonl).
USE_PDL_ABOVE_BATCH_1 = False


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr,
    v_scale_ptr, sm_scale, out_ptr, tickets_ptr,
    stride_q_seq, stride_q_head, stride_block, stride_slot, stride_kv_head, stride_table,
    stride_o_seq, stride_o_head,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, FUSED_MERGE: tl.constexpr,
):  # fmt: skip
    if USE_PDL:  # q and the new token's KV are the previous kernels'; then the merge may launch
        gdc_wait()
        gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    # partials are [num_seqs, NUM_HEADS, NUM_SPLITS] (+ [HEAD_DIM] for the outputs)
    part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
    start = split * SPLIT_LEN
    d = tl.arange(0, HEAD_DIM)
    if NUM_SPLITS > 1 and start >= seq_len:  # (one split: split 0, never empty)
        tl.store(part_lse_ptr + part, tl.full([GROUP_PAD], float("-inf"), tl.float32), g_mask)
        if FUSED_MERGE:
            _draw_and_merge(part_out_ptr, part_lse_ptr, out_ptr, tickets_ptr, seq, kv_head,
                            heads, g_mask, d, stride_o_seq, stride_o_head, NUM_HEADS,
                            NUM_SPLITS, GROUP, HEAD_DIM)  # fmt: skip
        return
    end = tl.minimum(seq_len, start + SPLIT_LEN)
    n = tl.arange(0, BLOCK_N)
    q_offsets = seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    k_scale = tl.load(k_scale_ptr) if IS_FP8 else 1.0
    v_scale = tl.load(v_scale_ptr) if IS_FP8 else 1.0

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile in range(start, end, BLOCK_N):  # every tile has a valid lane: the max stays finite
        pos = tile + n
        valid = pos < end
        safe_pos = tl.where(valid, pos, start)  # masked lanes address a position we own
        m, denom, acc = attend_tile(
            q, m, denom, acc, k_ptr, v_ptr, tables_ptr + seq * stride_table, safe_pos, valid,
            valid[None, :], kv_head, d, k_scale, v_scale, sm_scale, stride_block, stride_slot,
            stride_kv_head, BLOCK_SIZE, IS_FP8, DOT_PRECISION,
        )  # fmt: skip
    if NUM_SPLITS == 1:  # the output itself (part_out_ptr is the output tensor): no merge
        o_offsets = seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
        out = acc / denom[:, None]
        tl.store(part_out_ptr + o_offsets, out.to(part_out_ptr.dtype.element_ty),
                 mask=g_mask[:, None])  # fmt: skip
        return
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / denom[:, None],
             mask=g_mask[:, None])  # fmt: skip
    tl.store(part_lse_ptr + part, m + tl.log(denom), mask=g_mask)
    if FUSED_MERGE:
        _draw_and_merge(part_out_ptr, part_lse_ptr, out_ptr, tickets_ptr, seq, kv_head, heads,
                        g_mask, d, stride_o_seq, stride_o_head, NUM_HEADS, NUM_SPLITS,
                        GROUP, HEAD_DIM)  # fmt: skip


@triton.jit
def _draw_and_merge(
    part_out_ptr, part_lse_ptr, out_ptr, tickets_ptr, seq, kv_head, heads, g_mask, d,
    stride_o_seq, stride_o_head, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """A split program's ticket; the last of its (sequence, kv head) merges the group's heads
    (the module docstring)."""
    tl.debug_barrier()  # every thread's partials are stored before the ticket is drawn
    ticket_ptr = tickets_ptr + seq * (NUM_HEADS // GROUP) + kv_head
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == NUM_SPLITS - 1:  # every other split of the pair is out: merge them
        _merge_group(part_out_ptr, part_lse_ptr, out_ptr, seq, heads, g_mask, d, stride_o_seq,
                     stride_o_head, NUM_HEADS, NUM_SPLITS, HEAD_DIM)  # fmt: skip
        tl.store(ticket_ptr, 0)  # every other program has drawn: the next launch starts at 0


@triton.jit
def _merge_group(
    part_out_ptr, part_lse_ptr, out_ptr, seq, heads, g_mask, d, stride_o_seq, stride_o_head,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Writes the output of ``heads`` (one kv head's group, ``g_mask`` its real rows) of
    ``seq``: its splits' partials, each weighted by its share of the softmax mass. The partials
    are read from L2: this SM's L1 may hold another layer's at the same graph-pool address."""
    first = (seq * NUM_HEADS + heads) * NUM_SPLITS  # [GROUP_PAD]: each head's split 0
    top = tl.full(heads.shape, float("-inf"), tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        lse = tl.load(part_lse_ptr + first + split, mask=g_mask, other=float("-inf"),
                      cache_modifier=".cg")  # fmt: skip
        top = tl.maximum(top, lse)
    top = tl.where(g_mask, top, 0.0)  # split 0 is never empty: finite on every real head
    total = tl.zeros(heads.shape, tl.float32)
    acc = tl.zeros([heads.shape[0], HEAD_DIM], tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        lse = tl.load(part_lse_ptr + first + split, mask=g_mask, other=float("-inf"),
                      cache_modifier=".cg")  # fmt: skip
        weight = tl.exp(lse - top)
        partial = tl.load(part_out_ptr + (first + split)[:, None] * HEAD_DIM + d[None, :],
                          mask=(g_mask & (weight > 0))[:, None], other=0.0,
                          cache_modifier=".cg")  # fmt: skip
        acc += partial * weight[:, None]
        total += weight
    out = acc / tl.where(g_mask, total, 1.0)[:, None]
    o_offsets = seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_o_seq, stride_o_head,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, kv head): ``_merge_group``, what the tickets' last split
    program runs, so both paths give the same bits."""
    if USE_PDL:  # the partials are the split kernel's; then the O projection may launch (a
        gdc_wait()  # PDL GEMV, triton_gemv.py: it loads its weights; cuBLAS ignores the trigger)
        gdc_launch_dependents()
    seq = tl.program_id(0)
    g = tl.arange(0, GROUP_PAD)
    heads = tl.program_id(1) * GROUP + g
    _merge_group(part_out_ptr, part_lse_ptr, out_ptr, seq, heads, g < GROUP, tl.arange(0, HEAD_DIM),
                 stride_o_seq, stride_o_head, NUM_HEADS, NUM_SPLITS, HEAD_DIM)  # fmt: skip


def plan_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, wanted: int | None = None
) -> tuple[int, int]:
    """(splits, positions per split) of a decode launch: about ``PROGRAMS_PER_SM`` programs
    per SM (or ``wanted`` splits), at most ``MAX_NUM_SPLITS`` splits of whole tiles covering
    ``max_seq_len``; one split when the batch's (sequence, kv head) pairs reach that count
    alone."""
    if wanted is None:
        wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(num_seqs * num_kv_heads, 1))
    max_tiles = triton.cdiv(max_seq_len, BLOCK_N)
    num_splits = max(1, min(wanted, MAX_NUM_SPLITS, max_tiles))
    length = triton.cdiv(max_tiles, num_splits) * BLOCK_N
    return triton.cdiv(max_seq_len, length), length


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SM count (an H200's 132 off CUDA: Triton's interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    tickets: torch.Tensor | None = None,
    wanted_splits: int | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``query`` ``[num_seqs, num_heads, head_dim]`` (one token per sequence) → same shape.

    Preconditions: decode (``meta.max_query_len == 1``); ``1 <= seq_lens <= meta.max_seq_len``;
    ``head_dim`` a power of two, at least 16. Any block size. ``tickets``: the layer's merge
    tickets (``attention.new_merge_tickets``, on ``query``'s device), to merge the splits in
    the split kernel; never two launches on one layer's tickets at once. For tuning:
    ``wanted_splits`` overrides ``plan_splits``' count, ``pdl`` the PDL knobs
    (``triton_pdl.pdl_for``; off where the device has no PDL).
    """
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    group_pad = max(triton.next_power_of_2(group), 16)  # the query rows of a tensor-core tile
    num_splits, length = plan_splits(
        num_seqs, num_kv_heads, meta.max_seq_len, num_sms(query.device), wanted_splits
    )
    if tickets is not None and (tickets.dtype != torch.int32 or tickets.device != query.device):
        raise ValueError("tickets must be the layer's int32 merge tickets on query's device")
    is_fused = tickets is not None and num_splits > 1 and num_seqs * num_kv_heads <= tickets.numel()
    is_pdl = pdl_for(num_seqs, pdl, USE_PDL_AT_BATCH_1, USE_PDL_ABOVE_BATCH_1, query.device)
    out = torch.empty_like(query)
    if num_splits == 1:  # the split kernel writes ``out``; no partials, no merge
        part_out, part_lse = out, out
    else:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim),
                               dtype=torch.float32, device=query.device)  # fmt: skip
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                               device=query.device)  # fmt: skip
    keys, values = kv_cache[0], kv_cache[1]
    _split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, keys, values, meta.block_tables, meta.seq_lens, part_out, part_lse, k_scale,
        v_scale, scale, out, tickets if is_fused else out,  # (unread without FUSED_MERGE)
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLIT_LEN=length, GROUP=group,
        GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        IS_FP8=kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", USE_PDL=is_pdl,
        FUSED_MERGE=is_fused, num_warps=4, num_stages=2, launch_pdl=is_pdl,
    )  # fmt: skip
    if num_splits == 1 or is_fused:
        return out
    _merge_kernel[(num_seqs, num_kv_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        USE_PDL=is_pdl, launch_pdl=is_pdl,
    )  # fmt: skip
    return out
