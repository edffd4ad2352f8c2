"""The model runner's per-step inputs: static device buffers in ``runtime``, filled from host.

The device buffers are allocated once, in the ``runtime`` tag, and never replaced: a captured
graph reads them at fixed addresses, and a sleep preserves them (HOST at every level). Each step
writes its first ``num_tokens`` / ``num_seqs`` entries from host staging arrays (pinned on CUDA)
with non-blocking copies, and the metadata views those prefixes. A host block-table row is
rewritten only when its blocks changed (``_stage_block_tables``); the copy to the device is
whole every step.

| buffer           | dtype | shape                         | entry                              |
|------------------|-------|-------------------------------|------------------------------------|
| input_ids        | int64 | [max_num_batched_tokens]      | token id of each new token         |
| positions        | int64 | [max_num_batched_tokens]      | its position in its sequence       |
| slot_mapping     | int64 | [max_num_batched_tokens]      | its KV slot: block * bs + offset   |
| logits_indices   | int64 | [max_num_seqs]                | index of each sequence's last token|
| seq_lens         | int32 | [max_num_seqs]                | context length after the step      |
| query_start_loc  | int32 | [max_num_seqs + 1]            | cumulative new-token counts        |
| block_tables     | int32 | [max_num_seqs, max_blocks]    | KV block ids; padding is never read|
| previous_rows    | int64 | [max_num_seqs]                | a row of the last launch (below)   |
| last_tokens      | int64 | [max_num_seqs]                | the last launch's sampled tokens   |

A step with ``previous_rows`` (the engine's async scheduling) has decode rows whose input
tokens the host does not know yet: row ``i`` takes the last token the previous launch sampled
for its row ``previous_rows[i]``, gathered on the device after the host's copies.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from operator import ne

import numpy as np
import torch

from dormant.core.config import EngineConfig
from dormant.core.step_input import StepInput
from dormant.layers.context import AttentionMetadata
from dormant.memory import RUNTIME, MemoryManager
from dormant.memory.census import host_staging

_TOKEN_BUFFERS = ("input_ids", "positions", "slot_mapping")


class InputBuffers:
    def __init__(self, mm: MemoryManager, config: EngineConfig, null_block: int) -> None:
        max_tokens, max_seqs = config.max_num_batched_tokens, config.max_num_seqs
        self.block_size = config.block_size
        self.null_block = null_block  # a KV block no sequence owns: padded rows write there
        specs = {
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "slot_mapping": ((max_tokens,), torch.int64),
            "logits_indices": ((max_seqs,), torch.int64),
            "seq_lens": ((max_seqs,), torch.int32),
            "query_start_loc": ((max_seqs + 1,), torch.int32),
            "block_tables": ((max_seqs, config.max_num_blocks_per_seq), torch.int32),
        }
        tensors = mm.empty_many(list(specs.values()), tag=RUNTIME)
        for tensor in tensors:
            tensor.zero_()  # padding entries of graph batches must point at valid slots
        (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.logits_indices,
            self.seq_lens,
            self.query_start_loc,
            self.block_tables,
        ) = tensors
        self.device_buffers: dict[str, torch.Tensor] = dict(zip(specs, tensors, strict=True))
        pin = mm.backend.device.type == "cuda"
        self._host = {  # host memory by design: the census leaves it out
            name: host_staging(torch.zeros(shape, dtype=dtype, pin_memory=pin))
            for name, (shape, dtype) in specs.items()
        }
        self._host_np = {name: t.numpy() for name, t in self._host.items()}
        # Outside ``device_buffers``: written only by the steps that use them.
        self.previous_rows, self.last_tokens = (
            t.zero_() for t in mm.empty_many([((max_seqs,), torch.int64)] * 2, tag=RUNTIME)
        )
        self._host_previous_rows = host_staging(
            torch.zeros((max_seqs,), dtype=torch.int64, pin_memory=pin)
        )
        # What each host block-table row holds (see _stage_block_tables); rows start unknown.
        self._staged_tables: list[tuple[int, ...] | None] = [None] * max_seqs

    def tensors(self) -> list[torch.Tensor]:
        """Every device buffer (what the pointer guard watches)."""
        return [*self.device_buffers.values(), self.previous_rows, self.last_tokens]

    def keep_last_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Copies a launch's sampled tokens (int64 [n], a temporary) into ``last_tokens``, so
        the next launch may take its input tokens from there; returns that prefix. A device
        copy: no tensor outside the tags outlives the step."""
        kept = self.last_tokens[: tokens.shape[0]]
        kept.copy_(tokens)
        return kept

    def load(
        self,
        step: StepInput,
        pad_to: int | None = None,
        previous_tokens: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Stages ``step`` on the host, copies it into the device buffers, returns the metadata.

        ``pad_to`` (decode only) fills rows ``num_seqs .. pad_to`` with a harmless dummy
        sequence: one token at position 0 whose KV goes to the reserved null block, so a graph
        captured for ``pad_to`` sequences can run a smaller batch.
        ``previous_tokens`` (device, one per row of the previous launch) are what rows take as
        their input tokens when ``step.previous_rows`` is set (a decode step, one entry per
        row: ``StepInput``): their host token ids are placeholders. A row index outside them
        raises ``ValueError`` before anything is written.
        Precondition: the previous step's copies have completed (the runner synchronizes when it
        reads the sampled tokens), so the host staging arrays may be overwritten.
        """
        seqs = step.seqs
        num_seqs = len(seqs)
        if step.previous_rows is not None:
            self._check_previous_rows(step.previous_rows, previous_tokens, num_seqs)
        h = self._host_np
        token_ids = [s.token_ids for s in seqs]
        query_lens = np.fromiter(map(len, token_ids), np.int64, num_seqs)
        num_tokens = int(query_lens.sum())
        starts = np.fromiter((s.start_position for s in seqs), np.int64, num_seqs)
        h["input_ids"][:num_tokens] = np.fromiter(
            itertools.chain.from_iterable(token_ids), np.int64, num_tokens
        )
        cu = h["query_start_loc"][: num_seqs + 1]
        cu[0] = 0
        np.cumsum(query_lens, out=cu[1:])
        is_decode = bool((query_lens == 1).all())  # then token i is row i's, at its start
        row_of_token = (
            np.arange(num_seqs) if is_decode else np.repeat(np.arange(num_seqs), query_lens)
        )
        positions = starts
        if not is_decode:
            positions = np.arange(num_tokens) + (starts - cu[:-1])[row_of_token]
        h["positions"][:num_tokens] = positions
        max_blocks = self._stage_block_tables([s.block_table for s in seqs])
        tables = h["block_tables"]
        blocks = tables[row_of_token, positions // self.block_size].astype(np.int64)
        h["slot_mapping"][:num_tokens] = blocks * self.block_size + positions % self.block_size
        seq_lens = starts + query_lens
        h["seq_lens"][:num_seqs] = seq_lens
        np.subtract(cu[1:], 1, out=h["logits_indices"][:num_seqs])
        rows, width = num_seqs, max_blocks
        if pad_to is not None and pad_to > num_seqs:
            if num_tokens != num_seqs:
                raise ValueError("only decode steps (one token per sequence) can be padded")
            self._stage_padding(num_seqs, pad_to)
            rows, num_tokens, width = pad_to, pad_to, tables.shape[1]

        counts = {"logits_indices": rows, "seq_lens": rows, "query_start_loc": rows + 1}
        for name, device_buffer in self.device_buffers.items():
            if name == "block_tables":
                device_buffer[:rows, :width].copy_(
                    self._host[name][:rows, :width], non_blocking=True
                )
                continue
            n = num_tokens if name in _TOKEN_BUFFERS else counts[name]
            device_buffer[:n].copy_(self._host[name][:n], non_blocking=True)
        if step.previous_rows is not None:
            assert previous_tokens is not None  # _check_previous_rows
            self._take_previous_tokens(step.previous_rows, previous_tokens, num_seqs)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:rows, :width],
            seq_lens=self.seq_lens[:rows],
            query_start_loc=self.query_start_loc[: rows + 1],
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )

    @staticmethod
    def _check_previous_rows(
        rows: Sequence[int], previous: torch.Tensor | None, num_seqs: int
    ) -> None:
        """Raises ``ValueError``, before anything is written, unless ``rows`` has one entry per
        row, each a row of the previous launch's ``previous`` tokens."""
        array = np.asarray(rows, np.int64)
        if array.shape != (num_seqs,):
            raise ValueError(f"previous_rows has {array.size} entries for {num_seqs} rows")
        num_previous = 0 if previous is None else previous.shape[0]
        if array.size and (array.min() < 0 or array.max() >= num_previous):
            raise ValueError(
                f"previous_rows range over {int(array.min())}..{int(array.max())}, but the "
                f"last launch sampled {num_previous} rows: each row must name one of them"
            )

    def _take_previous_tokens(
        self, rows: Sequence[int], previous: torch.Tensor, num_seqs: int
    ) -> None:
        """``input_ids[i] = previous[rows[i]]`` on the device, after the input copies (a decode
        step: token ``i`` is row ``i``'s)."""
        self._host_previous_rows.numpy()[:num_seqs] = rows
        device_rows = self.previous_rows[:num_seqs]
        device_rows.copy_(self._host_previous_rows[:num_seqs], non_blocking=True)
        torch.index_select(previous, 0, device_rows, out=self.input_ids[:num_seqs])

    def _stage_block_tables(self, block_tables: list[tuple[int, ...]]) -> int:
        """Writes each row's block table into the host staging table; returns the widest.

        A row whose staged table equals its new one is not written again (a decode row's
        table changes once every ``block_size`` steps): ``_staged_tables[row]`` is exactly
        what the host row holds in its first ``len`` entries, or None when unknown. Compared
        by value, so a new tuple of the same blocks (every step's) is a hit, and any change
        of a row's blocks, or another sequence in that row, is written. A row that only grew
        (its staged table a prefix of the new one: decode appended blocks) gets its new
        entries alone; every write of the step is one numpy assignment.
        """
        tables, staged = self._host_np["block_tables"], self._staged_tables
        num_rows = len(block_tables)
        if staged[:num_rows] != block_tables:  # one C-level comparison when every row hits
            rows: list[int] = []
            columns: list[int] = []
            values: list[int] = []
            changed = np.flatnonzero(np.fromiter(map(ne, staged, block_tables), np.bool_, num_rows))
            for row in changed.tolist():
                table, old = block_tables[row], staged[row]
                num_blocks = len(table)
                first = 0
                if old is not None and len(old) < num_blocks and table[: len(old)] == old:
                    first = len(old)
                if first + 1 == num_blocks:  # one block appended: the common change
                    rows.append(row)
                    columns.append(first)
                    values.append(table[first])
                else:
                    rows += [row] * (num_blocks - first)
                    columns += range(first, num_blocks)
                    values += table[first:]
                staged[row] = tuple(table)  # a copy if it was a list its owner may change
            tables[rows, columns] = values
        return max(map(len, block_tables))

    def _stage_padding(self, start: int, stop: int) -> None:
        h = self._host_np
        self._staged_tables[start:stop] = [None] * (stop - start)
        h["input_ids"][start:stop] = 0
        h["positions"][start:stop] = 0
        h["slot_mapping"][start:stop] = self.null_block * self.block_size
        h["seq_lens"][start:stop] = 1
        h["logits_indices"][start:stop] = np.arange(start, stop)
        h["query_start_loc"][start + 1 : stop + 1] = np.arange(start + 1, stop + 1)
        h["block_tables"][start:stop, :] = self.null_block

    def fill_padding(self) -> None:
        """Makes every row a dummy sequence (before capturing graphs)."""
        self._stage_padding(0, self.seq_lens.shape[0])
        for name, device_buffer in self.device_buffers.items():
            device_buffer.copy_(self._host[name][: device_buffer.shape[0]])


class Staging:
    """A reusable host buffer (pinned on CUDA) that brings small per-step arrays to the device
    in one non-blocking copy.

    It grows (doubling) when a step needs more. Precondition of ``stage``: the previous
    step's copy from it has completed (the runner waits for each step's results), and the
    tensors it returned are no longer used (on the CPU they view the buffer itself).
    """

    def __init__(self, device: torch.device, capacity: int = 4096) -> None:
        self.device = device
        self._host = self._allocate(capacity)

    def stage(
        self, ints: Sequence[np.ndarray], floats: Sequence[np.ndarray] = ()
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies the int64 ``ints`` and float32 ``floats`` to the device; returns them there,
        in order. Each float array takes whole int64 entries (two float32 each)."""
        lengths = [a.size for a in ints] + [(a.size + 1) // 2 for a in floats]
        ends = [0, *itertools.accumulate(lengths)]
        if ends[-1] > self._host.shape[0]:
            self._host = self._allocate(max(ends[-1], 2 * self._host.shape[0]))
        host = self._host.numpy()
        for i, array in enumerate(ints):
            host[ends[i] : ends[i + 1]] = array
        for i, array in enumerate(floats, start=len(ints)):
            host[ends[i] : ends[i + 1]].view(np.float32)[: array.size] = array
        device = self._host[: ends[-1]].to(self.device, non_blocking=True)
        views = [device[ends[i] : ends[i + 1]] for i in range(len(lengths))]
        float_views = [
            view.view(torch.float32)[: array.size]
            for view, array in zip(views[len(ints) :], floats, strict=True)
        ]
        return views[: len(ints)], float_views

    def _allocate(self, capacity: int) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return host_staging(torch.empty(capacity, dtype=torch.int64, pin_memory=pin))
