"""The draft passes of one fused speculative round (``spec_rounds.py``), on the device only: a
draft model's (here) and MTP's (``mtp_rounds.py``), behind one interface, ``RoundDrafts``.

Per replay, ``SpecRounds.body`` calls ``begin`` once (the rows' block tables), then per round
``propose`` (the round's ``k`` drafts of each row) and, after the verification, ``feed_back``
(the draft's state for the next round: what it must catch up on). A row's first round starts
from the host: ``host_arrays`` of the batch, staged with the rounds' own, then ``load``;
``pad`` makes dummy rows (the null block, position 0). ``fits`` says whether a row's draft state
is one the replay computes (``SpecRounds.fits`` checks the rest).

A draft model's round (lag 0): ``k + 1`` one-token passes of the draft at ``p .. p + k`` (``p``:
the position of the row's newest token): the newest token, then each draft fed back; the first
``k`` propose ``d_1 .. d_k`` (argmax), the last only writes ``d_k``'s draft KV, so that the draft
never trails the target and the next round's catch-up is again the newest token alone
(``spec_inputs.py``). So it keeps no state between rounds, and a row fits when its draft has
nothing to catch up on but its newest token.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Protocol

import numpy as np
import torch

from dormant.core.step_input import SeqInput
from dormant.layers.context import forward_context
from dormant.worker.draft_decoder import DraftDecoder


class RoundDrafts(Protocol):
    """A draft's passes inside the fused rounds (see the module)."""

    lag: int  # 0: the draft computes the target's positions; 1: one behind (MTP)

    def tensors(self) -> list[torch.Tensor]:
        """Its own state buffers (fixed addresses a replay reads), beyond its decoder's."""
        ...

    def fits(self, seq: SeqInput) -> bool: ...

    def host_arrays(self, seqs: SequenceOf[SeqInput]) -> list[np.ndarray]:
        """The first round's draft state of ``seqs`` (int64 arrays to stage)."""
        ...

    def load(self, views: list[torch.Tensor], num_rows: int) -> None:
        """Rows ``0 .. num_rows``'s state from the device views of ``host_arrays``."""
        ...

    def pad(self, start: int, bs: int) -> None:
        """Rows ``start .. bs`` become dummy rows (the null block, position 0)."""
        ...

    def begin(self, bs: int, tables: torch.Tensor) -> None:
        """A replay's start: the passes read the rows' block tables ``tables``."""
        ...

    def propose(
        self, bs: int, tables: torch.Tensor, newest: torch.Tensor, position: torch.Tensor
    ) -> torch.Tensor:
        """One round's drafts ``d_1 .. d_k`` of each row (int64 [bs, k]), the newest tokens at
        ``position``."""
        ...

    def feed_back(
        self, bs: int, position: torch.Tensor, emitted: torch.Tensor, accepted: torch.Tensor
    ) -> None:
        """After the round's verification (``position`` not yet advanced): the next round's
        state; ``emitted``: the round's tokens (int64 [bs, k + 1], -1 past the last),
        ``accepted``: each row's accepted drafts."""
        ...


class ModelRoundDrafts:
    """A draft model's passes of a round (see the module), through ``decoder``'s buffers."""

    lag = 0

    def __init__(self, decoder: DraftDecoder, num_drafts: int) -> None:
        self.decoder, self.num_drafts = decoder, num_drafts
        self.block_size = decoder.inputs.block_size

    def tensors(self) -> list[torch.Tensor]:
        return []  # the decoder's buffers are guarded with it

    def fits(self, seq: SeqInput) -> bool:
        return len(seq.token_ids) == 1 and not seq.draft_prefix_token_ids

    def host_arrays(self, seqs: SequenceOf[SeqInput]) -> list[np.ndarray]:
        return []

    def load(self, views: list[torch.Tensor], num_rows: int) -> None:
        """Nothing to load: a draft model keeps no state between rounds."""

    def pad(self, start: int, bs: int) -> None:
        """Its passes' query starts: one token per row, ``bs`` rows."""
        query_start_loc = self.decoder.inputs.query_start_loc
        query_start_loc[: bs + 1].copy_(torch.arange(bs + 1, device=query_start_loc.device))

    def begin(self, bs: int, tables: torch.Tensor) -> None:
        self.decoder.inputs.block_tables[:bs].copy_(tables)

    def propose(
        self, bs: int, tables: torch.Tensor, newest: torch.Tensor, position: torch.Tensor
    ) -> torch.Tensor:
        k, block_size = self.num_drafts, self.block_size
        inputs, graphs = self.decoder.inputs, self.decoder.graphs
        drafts = torch.empty((bs, k), dtype=torch.int64, device=newest.device)
        token = newest
        for i in range(k + 1):
            positions = position + i
            inputs.input_ids[:bs].copy_(token)
            inputs.positions[:bs].copy_(positions)
            inputs.seq_lens[:bs].copy_(positions + 1)
            inputs.slot_mapping[:bs].copy_(slots(tables, positions[:, None], block_size)[:, 0])
            if i == k:  # d_k's KV only: its logits would propose nothing
                with forward_context(graphs._meta(bs)):
                    self.decoder.model(inputs.input_ids[:bs], inputs.positions[:bs])
                break
            token = graphs._forward(bs).argmax(dim=-1)
            drafts[:, i].copy_(token)
        return drafts

    def feed_back(
        self, bs: int, position: torch.Tensor, emitted: torch.Tensor, accepted: torch.Tensor
    ) -> None:
        pass  # caught up but for the newest token, which the next round starts from


def slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV slots (int64, ``positions``' shape [bs, j]) of each row's ``positions``."""
    blocks = tables.gather(1, positions // block_size).long()
    return blocks * block_size + positions % block_size


__all__ = ["ModelRoundDrafts", "RoundDrafts", "slots"]
