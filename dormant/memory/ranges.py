"""Allocation of offsets inside a fixed-size range, with coalescing: first fit, or best fit.

Used for sub-allocating small tensors inside a slab (first fit) and for regions inside the host
arena (best fit: its chunks are sized for what they will hold).

Invariant: the free spans are sorted, disjoint, non-adjacent (always coalesced), and together with
the allocated spans they tile ``[0, size)`` exactly.
"""

from __future__ import annotations

import bisect


def align_up(value: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` that is ≥ ``value``."""
    return -(-value // alignment) * alignment


class RangeAllocator:
    """Hands out aligned ``[offset, offset + nbytes)`` spans of a range of ``size`` bytes."""

    def __init__(self, size: int, alignment: int = 256) -> None:
        self.size = size
        self.alignment = alignment
        self._free_starts: list[int] = [0]
        self._free_ends: list[int] = [size]
        self._allocated: dict[int, int] = {}
        self._allocated_bytes = 0

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    @property
    def allocated_bytes(self) -> int:
        return self._allocated_bytes

    @property
    def is_empty(self) -> bool:
        return not self._allocated

    @property
    def high_water(self) -> int:
        """The end of the last allocated span (0 when none is): everything after it is free."""
        if self._free_ends and self._free_ends[-1] == self.size:
            return self._free_starts[-1]
        return self.size

    def shrink(self, size: int) -> None:
        """Ends the range at ``size``, which must be at or past ``high_water``."""
        if not self.high_water <= size <= self.size:
            raise ValueError(
                f"cannot shrink to {size}: spans are allocated up to {self.high_water}"
            )
        if size < self.size:
            if self._free_starts[-1] == size:
                del self._free_starts[-1], self._free_ends[-1]
            else:
                self._free_ends[-1] = size
        self.size = size

    def tightest_fit(self, nbytes: int) -> int | None:
        """The length of the smallest free span that holds ``nbytes`` (aligned), or None."""
        need = align_up(max(nbytes, 1), self.alignment)
        lengths = map(int.__sub__, self._free_ends, self._free_starts)
        return min((n for n in lengths if n >= need), default=None)

    def allocate(self, nbytes: int, *, best_fit: bool = False) -> int | None:
        """The offset of a new span of ``nbytes`` (rounded to the alignment), or None if full:
        in the first free span that holds it, or with ``best_fit`` in the smallest one."""
        need = align_up(max(nbytes, 1), self.alignment)
        if self.size - self._allocated_bytes < need:
            return None  # cheap refusal: a full range is asked first-fit by every new block
        fits = (
            (end - start, i)
            for i, (start, end) in enumerate(zip(self._free_starts, self._free_ends, strict=True))
            if end - start >= need
        )
        found = min(fits, default=None) if best_fit else next(fits, None)
        if found is None:
            return None
        length, i = found
        start = self._free_starts[i]
        if length == need:
            del self._free_starts[i], self._free_ends[i]
        else:
            self._free_starts[i] = start + need
        self._allocated[start] = need
        self._allocated_bytes += need
        return start

    def free(self, offset: int) -> None:
        """Returns the span at ``offset``; raises KeyError if it is not allocated."""
        start = offset
        end = start + self._allocated.pop(offset)
        self._allocated_bytes -= end - start
        i = bisect.bisect_left(self._free_starts, start)
        merges_left = i > 0 and self._free_ends[i - 1] == start
        merges_right = i < len(self._free_starts) and self._free_starts[i] == end
        if merges_left and merges_right:
            self._free_ends[i - 1] = self._free_ends[i]
            del self._free_starts[i], self._free_ends[i]
        elif merges_left:
            self._free_ends[i - 1] = end
        elif merges_right:
            self._free_starts[i] = start
        else:
            self._free_starts.insert(i, start)
            self._free_ends.insert(i, end)
