"""MTP's draft passes inside the fused speculative rounds (``spec_rounds.py``,
``spec_round_drafts.RoundDrafts``): each round computes, on the device, what a single padded
MTP step computes (``spec_inputs.py``: padded MTP drafting; ``mtp_decoder.py``), through
``MTPDecoder``'s buffers and bodies.

MTP trails the target by one position (lag 1): its pass at ``q`` pairs the target's hidden
state there (the hidden cache) with the token at ``q + 1``. A round of a row whose newest token
is at ``p``:

1. **Catch-up** (``MTPDecoder._body(bs, None)``): ``W = k + 1`` positions from the catch-up
   start ``c``, its ``L`` real ones first (``valid``), the tokens one further (``ids``: the
   tokens at ``c + 1 .. c + L``, then 0); ``last`` is the row's ``L - 1``-th: ``d_1`` is the
   argmax there.
2. **Chained pass i = 1 .. k - 1** (``_body(bs, i % num_layers)``): ``d_i`` at ``p + i - 1``,
   reading the MTP hidden state of the pass before; ``d_{i+1}`` is the argmax.
3. After the verification (which writes the target's hidden states at ``p .. p + k`` into the
   hidden cache) and the acceptance of ``a`` drafts, the next round's catch-up: ``c = p``,
   ``L = a + 1``, its tokens the round's emitted tokens (the target's at ``p + 1 .. p + a + 1``).

So the state carried between rounds is (``c``, ``L``, ``ids``) per row; the first round's comes
from the host: each row's ``draft_start``, ``start_position - draft_start`` and the tokens of
``draft_prefix_token_ids + token_ids`` after the first, which fits when ``1 <= L <= W`` (every
decode step but a prompt's first). The draft's exact positions after the rounds are the last
round's ``p`` (``spec_outputs.draft_computed`` with lag 1).

| buffer (``runtime``) | shape               | what                                           |
|----------------------|---------------------|------------------------------------------------|
| start                | [max_bs] int64      | each row's catch-up start ``c``                |
| length               | [max_bs] int64      | its real catch-up positions ``L`` (0: dummy)   |
| ids                  | [max_bs, W] int64   | the catch-up's tokens, 0 past ``L``            |
| rows                 | [max(max_bs + 1, W)]| ``0, 1, ..`` (query starts, ``last``, offsets) |

Padding rows start as ``MTPDecoder._pad``'s (position 0, the null block, nothing valid); later
rounds catch them up in the null block, on hidden states the verification wrote there.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np
import torch

from dormant.core.step_input import SeqInput
from dormant.memory import RUNTIME, MemoryManager
from dormant.worker.mtp_decoder import MTPDecoder
from dormant.worker.spec_round_drafts import slots


class MTPRoundDrafts:
    """MTP's passes of a round (see the module), through ``mtp``'s buffers."""

    lag = 1

    def __init__(self, mtp: MTPDecoder, mm: MemoryManager) -> None:
        self.mtp = mtp
        self.width, self.num_drafts = mtp.width, mtp.num_drafts
        self.block_size = mtp.inputs.block_size
        self.num_layers = mtp.draft.model.num_layers
        bs, int64 = mtp.max_rows, torch.int64
        num_rows = max(bs + 1, self.width)  # row indices, and the catch-up's offsets
        shapes = [((bs,), int64), ((bs,), int64), ((bs, self.width), int64), ((num_rows,), int64)]
        self.start, self.length, self.ids, self.rows = mm.empty_many(shapes, RUNTIME)
        for tensor in (self.start, self.length, self.ids):
            tensor.zero_()
        self.rows.copy_(torch.arange(num_rows, device=self.rows.device))

    def tensors(self) -> list[torch.Tensor]:
        return [self.start, self.length, self.ids, self.rows]  # MTPDecoder's are guarded with it

    def fits(self, seq: SeqInput) -> bool:
        """One newest token, and 1 .. W positions to catch up on (padded MTP drafting's)."""
        return len(seq.token_ids) == 1 and 1 <= len(seq.draft_prefix_token_ids) <= self.width

    def host_arrays(self, seqs: SequenceOf[SeqInput]) -> list[np.ndarray]:
        """Each row's ``c``, ``L`` and catch-up tokens (``SpecLayout.of`` with lag 1)."""
        n, w = len(seqs), self.width
        starts = np.fromiter((s.draft_start for s in seqs), np.int64, n)
        lengths = np.fromiter((len(s.draft_prefix_token_ids) for s in seqs), np.int64, n)
        ids = np.zeros((n, w), np.int64)
        for row, seq in enumerate(seqs):  # the tokens at c + 1 .. p: the prefix's after its first
            known = (*seq.draft_prefix_token_ids, *seq.token_ids)
            ids[row, : lengths[row]] = known[1 : 1 + lengths[row]]
        return [starts, lengths, ids.reshape(-1)]

    def load(self, views: list[torch.Tensor], num_rows: int) -> None:
        starts, lengths, ids = views
        self.start[:num_rows].copy_(starts)
        self.length[:num_rows].copy_(lengths)
        self.ids[:num_rows].copy_(ids.view(num_rows, self.width))

    def pad(self, start: int, bs: int) -> None:
        self.start[start:bs].zero_()
        self.length[start:bs].zero_()
        self.ids[start:bs].zero_()

    def begin(self, bs: int, tables: torch.Tensor) -> None:
        self.mtp.inputs.block_tables[:bs].copy_(tables)

    def propose(
        self, bs: int, tables: torch.Tensor, newest: torch.Tensor, position: torch.Tensor
    ) -> torch.Tensor:
        mtp, inputs, w, block_size = self.mtp, self.mtp.inputs, self.width, self.block_size
        rows, offsets = self.rows[: bs + 1], self.rows[:w]
        drafts = torch.empty((bs, self.num_drafts), dtype=torch.int64, device=newest.device)
        # the catch-up: W positions from c per row, its L real ones valid
        start, length = self.start[:bs], self.length[:bs]
        positions = start[:, None] + offsets[None, :]  # [bs, W]
        num_tokens = bs * w
        inputs.input_ids[:num_tokens].copy_(self.ids[:bs].reshape(-1))
        inputs.positions[:num_tokens].copy_(positions.reshape(-1))
        inputs.slot_mapping[:num_tokens].copy_(slots(tables, positions, block_size).reshape(-1))
        inputs.seq_lens[:bs].copy_(start + w)
        inputs.query_start_loc[: bs + 1].copy_(rows * w)
        mtp.valid[:num_tokens].copy_((offsets[None, :] < length[:, None]).reshape(-1))
        mtp.last[:bs].copy_(rows[:bs] * w + (length - 1).clamp(min=0))
        token = mtp._body(bs, None).argmax(dim=-1)
        drafts[:, 0].copy_(token)
        if self.num_drafts > 1:  # the chained passes: one token per row
            inputs.query_start_loc[: bs + 1].copy_(rows)
        for i in range(1, self.num_drafts):  # d_i at p + i - 1 proposes d_{i+1}
            positions = position + (i - 1)
            inputs.input_ids[:bs].copy_(token)
            inputs.positions[:bs].copy_(positions)
            inputs.seq_lens[:bs].copy_(positions + 1)
            inputs.slot_mapping[:bs].copy_(slots(tables, positions[:, None], block_size)[:, 0])
            token = mtp._body(bs, i % self.num_layers).argmax(dim=-1)
            drafts[:, i].copy_(token)
        return drafts

    def feed_back(
        self, bs: int, position: torch.Tensor, emitted: torch.Tensor, accepted: torch.Tensor
    ) -> None:
        """The next catch-up: from ``p``, ``a + 1`` positions, the round's emitted tokens."""
        self.start[:bs].copy_(position)
        self.length[:bs].copy_(accepted + 1)
        self.ids[:bs].copy_(emitted.clamp(min=0))


__all__ = ["MTPRoundDrafts"]
