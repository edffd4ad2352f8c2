"""A GPU content hash at HBM speed, for skipping copies of unchanged memory (DESIGN §2.6).

Each 4-byte word ``w`` at position ``i`` of a span feeds four 32-bit lanes (mod 2^32):

    lane 0  Σ h            with h = fmix32(w ^ key(i)), the murmur3 finalizer (a bijection)
    lane 1  Σ h · k1(i)    lanes 1-3 multiply by odd, position-dependent keys
    lane 2  Σ w · k2(i)
    lane 3  Σ (h ^ w) · k3(i)

giving a 128-bit digest. Why these, and what they guarantee:

- Any single changed word always changes lane 0 (h is a bijection of w), and lanes 2 and 3 too
  (an odd key is invertible mod 2^32): one flipped byte anywhere is always detected.
- Keys depend on the position, so moved or swapped words are detected as well.
- It detects accidental change; it is not a defence against an adversary.
- Cost: measured on an H200 (benchmarks/vmm_costs.py), 8 GiB in 2.3 ms (3.8 TB/s), against
  10.9 ms for three finalizers per word with 64-bit lanes. Only one finalizer per word is paid;
  the other lanes are a multiply-add each.

All spans are hashed by one kernel launch over a table of 64 KiB work items; the per-item sums
come back in one copy and are added up per span on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from dormant.memory.backend import Span
from dormant.memory.dlpack import tensor_at

_BLOCK = 1024  # words per tile
_TILES = 16  # tiles per program: each program hashes 64 KiB
_WORDS_PER_PROGRAM = _BLOCK * _TILES


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _hash_kernel(base, table, out, BLOCK: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    # table rows: (first word of the program, relative to ``base``; number of words; position
    # of that word in its span). Addressing relative to an aligned pointer argument, with the
    # offset declared a multiple of 4 words, lets the compiler issue 16-byte loads; a pointer
    # made from an integer could not be vectorized (8 GiB took 34 ms instead of ~2.3).
    start = tl.multiple_of(tl.load(table + pid * 3), 4)
    num_words = tl.load(table + pid * 3 + 1)
    first = tl.load(table + pid * 3 + 2)
    words = base + start
    lane0 = tl.zeros([BLOCK], dtype=tl.uint32)
    lane1 = tl.zeros([BLOCK], dtype=tl.uint32)
    lane2 = tl.zeros([BLOCK], dtype=tl.uint32)
    lane3 = tl.zeros([BLOCK], dtype=tl.uint32)
    for t in range(TILES):
        offsets = t * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < num_words
        w = tl.load(words + offsets, mask=mask, other=0).to(tl.uint32, bitcast=True)
        position = first + offsets
        p = position.to(tl.uint32) ^ ((position >> 32).to(tl.uint32) * 0x85EBCA77)
        h = tl.where(mask, _fmix32(w ^ (p * 0x9E3779B1)), 0)  # masked words add nothing
        lane0 += h
        lane1 += h * ((p * 0x85EBCA77 + 0x165667B1) | 1)
        lane2 += w * ((p * 0xC2B2AE3D + 0x27D4EB2F) | 1)
        lane3 += (h ^ w) * ((p * 0x61C88647 + 0x2545F491) | 1)
    row = out + pid * 4
    tl.store(row, tl.sum(lane0).to(tl.int32, bitcast=True))
    tl.store(row + 1, tl.sum(lane1).to(tl.int32, bitcast=True))
    tl.store(row + 2, tl.sum(lane2).to(tl.int32, bitcast=True))
    tl.store(row + 3, tl.sum(lane3).to(tl.int32, bitcast=True))


def _work_table(spans: Sequence[Span], base: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of (first word relative to ``base``, words, first position) per program, and each
    program's span index."""
    rows, owners = [], []
    for index, span in enumerate(spans):
        if span.nbytes % 16 or span.address % 16 or (span.address - base) % 16:
            raise ValueError(f"content hash needs 16-byte aligned spans, got {span}")
        num_words = span.nbytes // 4
        first = np.arange(0, num_words, _WORDS_PER_PROGRAM, dtype=np.int64)
        start = (span.address - base) // 4 + first
        count = np.minimum(_WORDS_PER_PROGRAM, num_words - first)
        rows.append(np.stack([start, count, first], 1))
        owners.append(np.full(len(first), index, dtype=np.int64))
    return np.concatenate(rows), np.concatenate(owners)


def hash_spans(
    spans: Sequence[Span], device: torch.device, base: torch.Tensor | None = None
) -> list[bytes]:
    """A 128-bit digest of each span of device memory: one kernel launch, one host sync.

    ``base`` is the pointer argument every span is addressed relative to; by default an int32
    view at the lowest span address (tests pass a tensor covering every span instead).
    """
    if not spans:
        return []
    if base is None:
        base = tensor_at(min(s.address for s in spans), 16, device, _nothing).view(torch.int32)
    rows, owners = _work_table(spans, base.data_ptr())
    table = torch.from_numpy(rows).to(device)
    partials = torch.empty((len(rows), 4), dtype=torch.int32, device=device)
    _hash_kernel[(len(rows),)](base, table, partials, BLOCK=_BLOCK, TILES=_TILES)
    # The per-span sums on the host: 16 bytes per 64 KiB hashed (2 MiB for 8 GiB), and no
    # device-side atomics (torch's index_add_ took 11 ms of contended atomics for 8 GiB).
    starts = np.flatnonzero(np.diff(owners, prepend=-1))
    sums = np.add.reduceat(partials.cpu().numpy().astype(np.int64), starts, axis=0)
    lanes = (sums & 0xFFFFFFFF).astype(np.uint32)  # each lane is a sum mod 2^32
    return [row.tobytes() for row in lanes]


def _nothing() -> None:
    """The view of ``base`` owns nothing: dropping it frees nothing."""
