"""A step's logprobs as the worker reads them back: the packed rows and three columns, not
Python objects per token (as vLLM V1 carries ``LogprobsLists`` up to its output processor).

A decode step of ``n`` rows and ``num_steps`` steps has ``num_steps * n`` packed rows
(``worker/logprobs.py``'s layout: the token, its rank, its value as float32 bits, then the top
``k`` ids and values), step-major. ``PackedLogprobs`` owns them, with the three columns
every report reads (the tokens, their logprobs and ranks) as Python lists, made once per step
in C; each row's ``RowLogprobs`` is a ``Sequence[TokenLogprobs]`` over them that makes a
``TokenLogprobs`` only when one is read. The engine's common case (``logprobs=0``, or no top
tokens carried) reads the columns directly (``RowLogprobs.columns``), so no per-token object
is made between the device's values and vLLM's ``Logprob``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from collections.abc import Sequence as SequenceOf
from itertools import repeat
from typing import overload

import numpy as np

from dormant.core.step_output import TokenLogprobs

NUM_FIXED_COLUMNS = 3  # the token, its rank, its value


def unpack_logprobs(packed: np.ndarray) -> list[TokenLogprobs]:
    """One ``TokenLogprobs`` per packed row (int32 [m, 3 + 2k]); the top tokens' ranks are
    1 .. k.

    No row runs Python code: each field's columns become one list of tuples in numpy and C,
    and the named tuples are made by ``tuple.__new__`` (what ``TokenLogprobs._make`` does,
    without its Python frame).
    """
    num_top = (packed.shape[-1] - NUM_FIXED_COLUMNS) // 2
    values = packed.view(np.float32)
    token_ids: Iterable[tuple[int, ...]]
    logprobs: Iterable[tuple[float, ...]]
    ranks: Iterable[tuple[int, ...]]
    if num_top == 0:
        token_ids = zip(packed[:, 0].tolist())
        logprobs = zip(values[:, 2].tolist())
        ranks = zip(packed[:, 1].tolist())
    else:
        top_ids = slice(NUM_FIXED_COLUMNS, NUM_FIXED_COLUMNS + num_top)
        top_values = slice(NUM_FIXED_COLUMNS + num_top, NUM_FIXED_COLUMNS + 2 * num_top)
        top_ranks = np.broadcast_to(
            np.arange(1, num_top + 1, dtype=np.int32), (len(packed), num_top)
        )
        token_ids = map(tuple, np.concatenate([packed[:, :1], packed[:, top_ids]], 1).tolist())
        logprobs = map(tuple, np.concatenate([values[:, 2:3], values[:, top_values]], 1).tolist())
        ranks = map(tuple, np.concatenate([packed[:, 1:2], top_ranks], 1).tolist())
    return list(
        map(tuple.__new__, repeat(TokenLogprobs), zip(token_ids, logprobs, ranks, strict=True))
    )


class PackedLogprobs:
    """The packed logprobs of ``num_rows`` rows over ``num_steps`` steps (int32
    [num_steps * num_rows, 3 + 2k], step-major: entry ``step * num_rows + row``), owned: the
    caller passes a copy, not a view of a buffer the next step overwrites."""

    __slots__ = ("logprobs", "num_rows", "num_steps", "num_top", "packed", "ranks", "token_ids")

    def __init__(self, packed: np.ndarray, num_rows: int) -> None:
        self.packed = packed
        self.num_rows = num_rows
        self.num_steps = len(packed) // num_rows if num_rows else 0
        self.num_top = (packed.shape[-1] - NUM_FIXED_COLUMNS) // 2
        # Per entry: the token, its logprob and its rank (what unpack_logprobs puts first).
        self.token_ids: list[int] = packed[:, 0].tolist()
        self.logprobs: list[float] = packed[:, 2].view(np.float32).tolist()
        self.ranks: list[int] = packed[:, 1].tolist()

    def rows(self) -> list[RowLogprobs]:
        """Every row's entries, in row order."""
        return list(map(RowLogprobs, repeat(self), range(self.num_rows)))

    def entry(self, index: int) -> TokenLogprobs:
        """Entry ``index`` (``step * num_rows + row``), as ``unpack_logprobs`` reads it."""
        return unpack_logprobs(self.packed[index : index + 1])[0]


class RowLogprobs(SequenceOf[TokenLogprobs]):
    """One row's entries of a ``PackedLogprobs``, one per step: a sequence of
    ``TokenLogprobs``, each made when read. Equal to any sequence of the same entries (the
    tuple ``unpack_logprobs`` would have given)."""

    __slots__ = ("block", "row")

    def __init__(self, block: PackedLogprobs, row: int) -> None:
        self.block = block
        self.row = row

    def __len__(self) -> int:
        return self.block.num_steps

    @overload
    def __getitem__(self, index: int) -> TokenLogprobs: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[TokenLogprobs, ...]: ...

    def __getitem__(self, index: int | slice) -> TokenLogprobs | tuple[TokenLogprobs, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        num_steps = len(self)
        if not -num_steps <= index < num_steps:
            raise IndexError(f"step {index} of a row of {num_steps} steps")
        step = index % num_steps
        return self.block.entry(step * self.block.num_rows + self.row)

    def __iter__(self) -> Iterator[TokenLogprobs]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceOf) or isinstance(other, (str, bytes)):
            return NotImplemented
        return tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"RowLogprobs({tuple(self)!r})"

    def columns(self, count: int) -> tuple[list[int], list[float], list[int]]:
        """The first ``count`` steps' tokens, logprobs and ranks (each entry's first
        ``token_ids``, ``logprobs`` and ``ranks`` value), by list slicing in C."""
        block, row = self.block, self.row
        num_rows = block.num_rows
        entries = slice(row, row + min(count, block.num_steps) * num_rows, num_rows)
        return block.token_ids[entries], block.logprobs[entries], block.ranks[entries]
