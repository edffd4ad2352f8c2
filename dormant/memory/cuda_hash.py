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

All spans are hashed by one kernel launch, one program per 64 KiB; each program finds its span by
a binary search of a per-span table (so nothing per program is built on the host). A second kernel
adds up each span's programs, and the digests come back in one small copy.

One compiled kernel serves every sleep: the number of spans is a runtime argument that Triton is
told not to specialise on, and the search always takes ``SEARCH_STEPS`` steps (a step past the
table's end is masked). Before, both were compile-time constants, so the first sleep of every
new span count compiled a kernel (0.14 s in the 2026-12-01 first sleep of 195 spans).
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
_WORDS_PER_PROGRAM = 16 * _BLOCK  # each program hashes 64 KiB
SPAN_SUM_BLOCK = 256  # programs added per step by the span-sum kernel
SEARCH_STEPS = 20  # binary-search steps: up to 2**20 - 1 spans per launch
MAX_SPANS = (1 << SEARCH_STEPS) - 1


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit(do_not_specialize=["num_spans"])
def _hash_kernel(
    base, spans, out, num_spans, SEARCH_STEPS: tl.constexpr,
    WORDS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    # ``spans`` rows: (first word relative to ``base``, number of words, first program). This
    # program's span is the last whose first program is <= pid: a binary search of the table.
    lo = 0
    hi = num_spans
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        is_right = (mid < hi) & (tl.load(spans + mid * 3 + 2, mask=mid < num_spans) <= pid)
        lo = tl.where(is_right, mid, lo)
        hi = tl.where(is_right, hi, mid)
    first = (pid - tl.load(spans + lo * 3 + 2)) * WORDS_PER_PROGRAM  # position in the span
    num_words = tl.minimum(tl.load(spans + lo * 3 + 1) - first, WORDS_PER_PROGRAM)
    # Addressing relative to an aligned pointer argument, with the offset declared a multiple
    # of 4 words, lets the compiler issue 16-byte loads; a pointer made from an integer could
    # not be vectorized (8 GiB took 34 ms instead of ~2.3).
    words = base + tl.multiple_of(tl.load(spans + lo * 3) + first, 4)
    lane0 = tl.zeros([BLOCK], dtype=tl.uint32)
    lane1 = tl.zeros([BLOCK], dtype=tl.uint32)
    lane2 = tl.zeros([BLOCK], dtype=tl.uint32)
    lane3 = tl.zeros([BLOCK], dtype=tl.uint32)
    for t in range(WORDS_PER_PROGRAM // BLOCK):
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


@triton.jit
def _span_sum_kernel(
    partials, spans, out, WORDS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """One program per span: the wrapping sum of its programs' rows (a span's programs are
    consecutive, from its first program on)."""
    span = tl.program_id(0)
    first = tl.load(spans + span * 3 + 2)
    count = tl.cdiv(tl.load(spans + span * 3 + 1), WORDS_PER_PROGRAM)
    rows = tl.arange(0, BLOCK)
    lanes = tl.arange(0, 4)
    total = tl.zeros([BLOCK, 4], dtype=tl.uint32)
    for start in range(0, count, BLOCK):
        mask = (start + rows < count)[:, None]
        offsets = (first + start + rows)[:, None] * 4 + lanes[None, :]
        total += tl.load(partials + offsets, mask=mask, other=0).to(tl.uint32, bitcast=True)
    tl.store(out + span * 4 + lanes, tl.sum(total, axis=0).to(tl.int32, bitcast=True))


def span_table(spans: Sequence[Span], base: int) -> tuple[np.ndarray, int]:
    """Rows of (first word relative to ``base``, number of words, first program), one per span
    (int64), and the number of 64 KiB programs. Raises ValueError for an empty or misaligned
    span, or for more than ``MAX_SPANS`` spans."""
    if len(spans) > MAX_SPANS:
        raise ValueError(f"content hash takes at most {MAX_SPANS} spans a launch, got {len(spans)}")
    addresses = np.fromiter((s.address for s in spans), dtype=np.int64, count=len(spans))
    sizes = np.fromiter((s.nbytes for s in spans), dtype=np.int64, count=len(spans))
    is_bad = (
        (sizes <= 0) | (sizes % 16 != 0) | (addresses % 16 != 0) | ((addresses - base) % 16 != 0)
    )
    if is_bad.any():
        raise ValueError(
            f"content hash needs non-empty 16-byte aligned spans, got {spans[is_bad.argmax()]}"
        )
    num_words = sizes // 4
    num_programs = -(-num_words // _WORDS_PER_PROGRAM)
    first_program = np.cumsum(num_programs) - num_programs
    rows = np.stack([(addresses - base) // 4, num_words, first_program], 1)
    return rows, int(num_programs.sum())


class PendingHashes:
    """Digests being computed on the device: ``result()`` waits for them (an event) and returns
    one 16-byte digest per span. Holds the pinned buffers the copies use until then."""

    def __init__(self, table_host: torch.Tensor, digests_host: torch.Tensor, on_cuda: bool) -> None:
        self._buffers = (table_host, digests_host)
        self._event: torch.cuda.Event | None = None
        if on_cuda and digests_host.numel():
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> list[bytes]:
        if self._event is not None:
            self._event.synchronize()
        return [row.tobytes() for row in self._buffers[1].numpy().view(np.uint32)]


def start_hashes(
    spans: Sequence[Span], device: torch.device, base: torch.Tensor | None = None
) -> PendingHashes:
    """Starts hashing each span of device memory on the current stream and returns at once: a
    24-byte-per-span upload and a 16-byte-per-span download (both pinned and asynchronous, so
    that launching the next group never waits for this one), and two kernels.

    ``base`` is the pointer argument every span is addressed relative to; by default an int32
    view at the lowest span address (tests pass a tensor covering every span instead).
    Precondition: every span is non-empty and 16-byte aligned.
    """
    on_cuda = device.type == "cuda"  # else Triton's interpreter, on the CPU (tests)
    empty = torch.empty((0, 4), dtype=torch.int32)
    if not spans:
        return PendingHashes(empty, empty, on_cuda)
    if base is None:
        base = tensor_at(min(s.address for s in spans), 16, device, _nothing).view(torch.int32)
    rows, num_programs = span_table(spans, base.data_ptr())
    table_host = torch.from_numpy(rows).pin_memory() if on_cuda else torch.from_numpy(rows)
    table = table_host.to(device, non_blocking=True)
    partials = launch(base, table, num_programs)
    digests_host = torch.empty((len(spans), 4), dtype=torch.int32, pin_memory=on_cuda)
    digests_host.copy_(span_sums(partials, table), non_blocking=True)
    return PendingHashes(table_host, digests_host, on_cuda)


def hash_spans(
    spans: Sequence[Span], device: torch.device, base: torch.Tensor | None = None
) -> list[bytes]:
    """A 128-bit digest of each span of device memory (``start_hashes``, waited for)."""
    return start_hashes(spans, device, base).result()


def launch(base: torch.Tensor, table: torch.Tensor, num_programs: int) -> torch.Tensor:
    """Runs the hash kernel over the spans of ``table`` (on the device); returns each 64 KiB
    program's four lane sums."""
    partials = torch.empty((num_programs, 4), dtype=torch.int32, device=table.device)
    num_spans = len(table)
    _hash_kernel[(num_programs,)](
        base, table, partials, num_spans, SEARCH_STEPS=SEARCH_STEPS,
        WORDS_PER_PROGRAM=_WORDS_PER_PROGRAM, BLOCK=_BLOCK,
    )  # fmt: skip
    return partials


def span_sums(partials: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each span's four lanes: the sums mod 2^32 of its programs' lanes, added on the device
    (one program per span, no atomics; torch's index_add_ took 11 ms of contended atomics for
    8 GiB, and adding them on the host 2.8 ms)."""
    out = torch.empty((len(table), 4), dtype=torch.int32, device=partials.device)
    _span_sum_kernel[(len(table),)](
        partials, table, out, WORDS_PER_PROGRAM=_WORDS_PER_PROGRAM, BLOCK=SPAN_SUM_BLOCK
    )
    return out


def _nothing() -> None:
    """The view of ``base`` owns nothing: dropping it frees nothing."""
