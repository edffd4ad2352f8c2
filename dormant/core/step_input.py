"""What one engine step asks every worker to compute: plain, picklable data.

The scheduler decides on ``Sequence`` objects in the driver (``ScheduledBatch.step_input``);
workers (possibly in other processes, one per tensor-parallel rank) only ever see this.
"""

from __future__ import annotations

from dataclasses import dataclass

from dormant.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SeqInput:
    """One sequence's share of a step: tokens at positions ``start_position ..`` to compute,
    then one token to sample (the ``num_output_tokens``-th output, with ``seed``)."""

    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    params: SamplingParams
    seed: int
    num_output_tokens: int

    @property
    def seq_len(self) -> int:
        """Context length after this step."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepInput:
    seqs: tuple[SeqInput, ...]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)
