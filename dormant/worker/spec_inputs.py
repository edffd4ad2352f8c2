"""The host-side layout of a speculative step's passes, staged to the device in one copy.

A step runs (``worker/spec_step.py``): the draft's catch-up pass over every row, ``k_max - 1``
chained draft passes over the rows still drafting, then the target's pass (through the model
runner's own input buffers); each draft pass's metadata is a ``PassLayout``
(``pass_layout.py``). Every position of every pass is known on the host before the step starts,
whatever the drafts turn out to be: the ``i``-th draft of a row sits at position
``start_position + i``. So the metadata of all passes, and the index tensors that route drafts
and logits between them, are built here at once and copied with one non-blocking transfer;
only token *values* (the drafts) are written on the device.

| array (int64)       | shape                      | what                                     |
|---------------------|----------------------------|------------------------------------------|
| catch-up input ids  | [T0]                       | each row's draft prefix, then its tokens |
|                     |                            | (MTP: shifted by one, see below)         |
| catch-up last       | [n_spec]                   | index of each drafting row's last token  |
| pass i's rows       | [n_i]                      | drafting rows (of n_spec) with j > i     |
| target draft slots  | [sum j]                    | where drafts go in the target's input ids|
| target draft source | [sum j]                    | which entry of drafts [n_spec, k_max]    |
| target spec logits  | [n_spec * (k_max + 1)]     | hidden rows of [newest, d_1 .. d_k_max]  |
|                     |                            | (past a row's j: its last, repeated)     |
| target plain logits | [n_plain]                  | hidden row of each plain row's last token|
| max emitted         | [n_spec]                   | j + 1                                    |

A draft with ``lag = 1`` (MTP) computes position ``p`` from the target's hidden state there and
the token at ``p + 1``: its catch-up covers ``draft_start .. start_position - 1`` (positions the
target computed in earlier steps, whose hidden states are cached), with the tokens one further;
rows with nothing there are left out of it; its ``i``-th chained pass is at ``start + i - 1``.

**Padded MTP drafting** (``pad_to = K`` with ``lag = 1``, and every row's catch-up at most
``W = K + 1`` positions, as in every decode step but a prompt's first): the passes take the
static shapes that ``mtp_decoder.py`` replays from graphs, and the eager path computes the same.

| pass      | rows      | row ``r``                                                          |
|-----------|-----------|--------------------------------------------------------------------|
| catch-up  | every row | ``W`` positions from ``draft_start``: its ``L`` real ones, then     |
|           |           | ``W - L`` padding positions (token 0, ``catch_up_valid`` 0)         |
| chained i | every row | ``start + i - 1``, whatever its ``j`` (past it: padding drafts,    |
|           |           | cut by the verification)                                           |

Both use the verification's block tables, extended with the null block to cover ``start + K``.
Padding positions write draft KV past the row's exact positions (MTP's ``draft_computed`` is
``start``), which the next step's catch-up writes again before anything reads it. Padding reads
a previous hidden state of 0, not the hidden cache's stale entry (NaN after a poisoned wake).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
import torch

from dormant.core.step_input import SeqInput
from dormant.worker.pass_layout import PassLayout


@dataclass(frozen=True)
class SpecLayout:
    """Every host array of one speculative step (see the module's table)."""

    spec_rows: tuple[int, ...]  # rows (of the step) that draft, in order
    plain_rows: tuple[int, ...]
    num_drafts: tuple[int, ...]  # j of each spec row
    max_drafts: int  # k_max
    catch_up: PassLayout | None  # None: no row has anything to catch up (MTP only)
    catch_up_ids: np.ndarray
    catch_up_last: np.ndarray
    # pass i = 1 .. k_max - 1 (a draft model: .. k_max) and its rows (those with j > i; a
    # draft model: j >= i)
    chained: tuple[tuple[PassLayout, np.ndarray], ...]
    target_draft_slots: np.ndarray
    target_draft_source: np.ndarray
    target_spec_logits: np.ndarray
    target_plain_logits: np.ndarray
    max_emitted: np.ndarray
    # The padded verification (``pad_to = K``): every row computes K + 1 positions
    verify: PassLayout | None = None
    verify_first_ids: np.ndarray | None = None  # each row's newest token
    # Padded MTP drafting (see the module): 1 where a catch-up position is real, [n * (K + 1)]
    catch_up_valid: np.ndarray | None = None

    @property
    def is_padded_draft(self) -> bool:
        """Whether the draft's passes have padded MTP drafting's static shapes."""
        return self.catch_up_valid is not None

    @classmethod
    def of(
        cls,
        seqs: SequenceOf[SeqInput],
        block_size: int,
        lag: int = 0,
        pad_to: int | None = None,
        null_block: int = 0,
    ) -> SpecLayout:
        """``pad_to`` (every row drafting): verify ``pad_to`` drafts per row, the positions
        past a row's ``j`` writing KV past its length (or, past its blocks, the null block)."""
        spec_rows = tuple(r for r, s in enumerate(seqs) if s.num_draft_tokens)
        plain_rows = tuple(r for r, s in enumerate(seqs) if not s.num_draft_tokens)
        num_drafts = tuple(seqs[r].num_draft_tokens for r in spec_rows)
        k_max = pad_to or max(num_drafts, default=0)
        tables = [s.block_table for s in seqs]
        draft_ids = [(*s.draft_prefix_token_ids, *s.token_ids) for s in seqs]
        if lag:  # positions draft_start .. start - 1, each with the token after it
            draft_ids = [ids[1 : 1 + s.start_position - s.draft_start] for ids, s in
                         zip(draft_ids, seqs, strict=True)]  # fmt: skip
        members = [r for r, ids in enumerate(draft_ids) if ids]
        lengths = np.fromiter((len(draft_ids[r]) for r in members), np.int64, len(members))
        starts = np.fromiter((seqs[r].draft_start for r in members), np.int64, len(members))
        width = k_max + 1
        extended = None  # the verification's tables, covering start + K
        if pad_to is not None:
            extended = [
                (*s.block_table, *(null_block,) * (-(-(s.start_position + width) // block_size)
                                                    - len(s.block_table)))
                for s in seqs
            ]  # fmt: skip
        catch_up, catch_up_valid = None, None
        catch_up_last = np.zeros(0, np.int64)
        is_padded_draft = (
            bool(lag) and extended is not None and len(members) == len(seqs)
            and int(lengths.max(initial=0)) <= width
        )  # fmt: skip
        if is_padded_draft:
            assert extended is not None
            catch_up = PassLayout.of(starts, np.full(len(seqs), width), extended, block_size)
            is_real = np.arange(width)[None, :] < lengths[:, None]
            padded_ids = np.zeros((len(seqs), width), np.int64)
            padded_ids[is_real] = [t for ids in draft_ids for t in ids]
            draft_ids = [tuple(row) for row in padded_ids.tolist()]
            catch_up_last = np.arange(len(seqs), dtype=np.int64) * width + lengths - 1
            catch_up_valid = is_real.astype(np.int64).reshape(-1)
        elif members:
            catch_up = PassLayout.of(starts, lengths, [tables[r] for r in members], block_size)
            if spec_rows:
                pass_row = {row: n for n, row in enumerate(members)}
                ends = catch_up.query_start_loc[1:] - 1
                catch_up_last = ends[[pass_row[r] for r in spec_rows]]
        assert catch_up is not None or not spec_rows, "every drafting row has a position"
        chained = []
        spec_starts = np.asarray([seqs[r].start_position for r in spec_rows], np.int64)
        # A draft model also computes its last draft's KV (pass j of a row with j drafts, its
        # logits unused), so that it never trails the target: its next catch-up is one token.
        ahead = 0 if lag else 1
        for i in range(1, k_max + ahead):
            rows = np.asarray(
                [n for n, j in enumerate(num_drafts) if j + ahead > i or is_padded_draft],
                np.int64,
            )
            if not len(rows):
                break  # no row drafts this far (padded verification only)
            row_tables = [tables[spec_rows[n]] for n in rows]
            if is_padded_draft and extended is not None:
                row_tables = extended
            layout = PassLayout.of(
                spec_starts[rows] + i - lag, np.ones(len(rows), np.int64), row_tables, block_size
            )
            chained.append((layout, rows))
        # The target's pass: each row's real tokens, then its j drafts.
        target_lengths = np.fromiter(
            (len(s.token_ids) + s.num_draft_tokens for s in seqs), np.int64, len(seqs)
        )
        target_cu = np.concatenate([[0], np.cumsum(target_lengths)])
        slots, source, spec_logits = [], [], []
        for n, (row, j) in enumerate(zip(spec_rows, num_drafts, strict=True)):
            first = target_cu[row]  # the newest token; its drafts follow
            slots.append(first + 1 + np.arange(j))
            source.append(n * k_max + np.arange(j))
            spec_logits.append(first + np.minimum(np.arange(k_max + 1), j))
        empty = np.zeros(0, np.int64)
        verify, first_ids = None, None
        if extended is not None:
            assert not plain_rows, "the padded verification takes drafting rows only"
            slots, source = [], []  # the drafts land in the verification's own buffers
            spec_logits = [np.arange(len(spec_rows) * width)]
            starts = np.asarray([s.start_position for s in seqs], np.int64)
            verify = PassLayout.of(starts, np.full(len(seqs), width), extended, block_size)
            first_ids = np.asarray([s.token_ids[0] for s in seqs], np.int64)
        return cls(
            spec_rows=spec_rows,
            plain_rows=plain_rows,
            num_drafts=num_drafts,
            max_drafts=k_max,
            catch_up=catch_up,
            catch_up_ids=np.fromiter((t for ids in draft_ids for t in ids), np.int64),
            catch_up_last=catch_up_last,
            chained=tuple(chained),
            target_draft_slots=np.concatenate([empty, *slots]),
            target_draft_source=np.concatenate([empty, *source]),
            target_spec_logits=np.concatenate([empty, *spec_logits]),
            target_plain_logits=target_cu[1:][list(plain_rows)] - 1,
            max_emitted=np.asarray(num_drafts, np.int64) + 1,
            verify=verify,
            verify_first_ids=first_ids,
            catch_up_valid=catch_up_valid,
        )

    def arrays(self) -> list[np.ndarray]:
        """Everything to stage, in the order ``unpack`` reads it back."""
        catch_up = [] if self.catch_up is None else self.catch_up.arrays()
        arrays = [*catch_up, self.catch_up_ids, self.catch_up_last]
        for layout, rows in self.chained:
            arrays += [*layout.arrays(), rows]
        arrays += [
            self.target_draft_slots, self.target_draft_source, self.target_spec_logits,
            self.target_plain_logits, self.max_emitted,
        ]  # fmt: skip
        if self.verify is not None:
            assert self.verify_first_ids is not None
            arrays += [*self.verify.arrays(), self.verify_first_ids]
        if self.catch_up_valid is not None:
            arrays.append(self.catch_up_valid)
        return arrays

    def unpack(self, views: list[torch.Tensor]) -> SpecViews:
        """The device views of ``arrays()``, by name."""
        it = iter(views)

        def take(count: int) -> list[torch.Tensor]:
            return [next(it) for _ in range(count)]

        catch_up = None if self.catch_up is None else take(_PASS_ARRAYS)
        catch_up_ids, catch_up_last = take(2)
        chained = []
        for _ in self.chained:
            *pass_views, rows = take(_PASS_ARRAYS + 1)
            chained.append((pass_views, rows))
        target = take(5)
        verify = take(_PASS_ARRAYS + 1) if self.verify is not None else None
        valid = take(1)[0] if self.catch_up_valid is not None else None
        return SpecViews(catch_up, catch_up_ids, catch_up_last, chained, target, verify, valid)


_PASS_ARRAYS = 5  # PassLayout.arrays()


@dataclass(frozen=True)
class SpecViews:
    """``SpecLayout.arrays()`` on the device: each pass's ``PassLayout`` views, then the rest."""

    catch_up: list[torch.Tensor] | None
    catch_up_ids: torch.Tensor
    catch_up_last: torch.Tensor
    chained: list[tuple[list[torch.Tensor], torch.Tensor]]
    target: list[torch.Tensor]  # draft slots, draft source, spec logits, plain logits, max emitted
    verify: list[torch.Tensor] | None  # the padded verification's PassLayout views, first ids
    catch_up_valid: torch.Tensor | None = None  # padded MTP drafting's (see the module)
