"""A GPU content hash at HBM speed, for skipping copies of unchanged memory (DESIGN §2.6).

Each 4-byte word ``w`` at position ``i`` of a span is mixed with a position key,
``x = w ^ key(i)``, through three independent murmur3 finalizers ``h0, h1, h2`` (bijections on
32 bits). The digest is two 64-bit lanes, ``Σ h0`` and ``Σ h1·h2`` (mod 2^64): 128 bits.

- A change of any single word always changes lane 0 (``h0`` is a bijection and the sum of the
  other terms is unchanged), so one flipped byte anywhere is always detected.
- Moving words around changes their keys, so permutations are detected too.
- Unrelated changes collide with probability about 2^-64 per lane pair; the hash detects
  accidental change, it is not a defence against an adversary.

Every span is one launch's worth of work items: one kernel launch hashes all spans.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from dormant.memory.backend import Span

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
def _hash_kernel(table, out, BLOCK: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    # table rows: (address of the program's first word, number of words, position of first word)
    address = tl.load(table + pid * 3)
    num_words = tl.load(table + pid * 3 + 1)
    first = tl.load(table + pid * 3 + 2)
    words = address.to(tl.pointer_type(tl.uint32))
    lane0 = tl.zeros([BLOCK], dtype=tl.uint64)
    lane1 = tl.zeros([BLOCK], dtype=tl.uint64)
    for t in range(TILES):
        offsets = t * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < num_words
        w = tl.load(words + offsets, mask=mask, other=0)
        position = first + offsets
        key = position.to(tl.uint32) * 0x9E3779B1 ^ (position >> 32).to(tl.uint32) * 0x85EBCA77
        x = w ^ key
        h0 = _fmix32(x ^ 0x5BD1E995)
        h1 = _fmix32(x ^ 0xCC9E2D51)
        h2 = _fmix32(x ^ 0x1B873593)
        lane0 += tl.where(mask, h0.to(tl.uint64), 0)
        lane1 += tl.where(mask, h1.to(tl.uint64) * h2.to(tl.uint64), 0)
    tl.store(out + pid * 2, tl.sum(lane0).to(tl.int64, bitcast=True))
    tl.store(out + pid * 2 + 1, tl.sum(lane1).to(tl.int64, bitcast=True))


def _work_table(spans: Sequence[Span]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of (address, words, first position) per program, and each program's span index."""
    rows, owners = [], []
    for index, span in enumerate(spans):
        if span.nbytes % 4:
            raise ValueError(f"content hash needs a multiple of 4 bytes, got {span.nbytes}")
        num_words = span.nbytes // 4
        first = np.arange(0, num_words, _WORDS_PER_PROGRAM, dtype=np.int64)
        rows.append(
            np.stack(
                [
                    span.address + 4 * first,
                    np.minimum(_WORDS_PER_PROGRAM, num_words - first),
                    first,
                ],
                1,
            )
        )
        owners.append(np.full(len(first), index, dtype=np.int64))
    return np.concatenate(rows), np.concatenate(owners)


def hash_spans(spans: Sequence[Span], device: torch.device) -> list[bytes]:
    """A 128-bit digest of each span of device memory; one kernel launch, one host sync."""
    if not spans:
        return []
    rows, owners = _work_table(spans)
    table = torch.from_numpy(rows).to(device, non_blocking=False)
    partials = torch.empty((len(rows), 2), dtype=torch.int64, device=device)
    _hash_kernel[(len(rows),)](table, partials, BLOCK=_BLOCK, TILES=_TILES)
    sums = torch.zeros((len(spans), 2), dtype=torch.int64, device=device)
    sums.index_add_(0, torch.from_numpy(owners).to(device), partials)
    return [row.tobytes() for row in sums.cpu().numpy()]
