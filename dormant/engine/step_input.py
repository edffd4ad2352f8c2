"""What one engine step asks every worker to compute: plain, picklable data.

The scheduler decides on ``Sequence`` objects in the driver; workers (possibly in other
processes, one per tensor-parallel rank) only ever see this.
"""

from __future__ import annotations

from dataclasses import dataclass

from dormant.engine.batch import ScheduledBatch
from dormant.engine.sampling_params import SamplingParams


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

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> StepInput:
        seqs = []
        for seq in batch.seqs:
            if batch.is_prefill:
                start = seq.num_computed_tokens
                token_ids = tuple(seq.token_ids[start:])
            else:
                start, token_ids = seq.num_tokens - 1, (seq.last_token_id,)
            seqs.append(
                SeqInput(
                    token_ids=token_ids,
                    start_position=start,
                    block_table=tuple(seq.block_table),
                    params=seq.params,
                    seed=seq.seed,
                    num_output_tokens=seq.num_output_tokens,
                )
            )
        return cls(tuple(seqs), batch.is_prefill)
