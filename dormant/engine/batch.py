"""What one scheduling step is: its limits (``SchedulerConfig``) and its result
(``ScheduledBatch``)."""

from __future__ import annotations

from dataclasses import dataclass

from dormant.core.step_input import SeqInput, StepInput
from dormant.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    Attributes:
        max_num_seqs: most sequences running at once (the largest decode batch).
        max_num_batched_tokens: most tokens computed in one step.
        max_model_len: most positions a sequence's KV may use.
        num_decode_steps: decode steps one batch may run at once (the worker's fused
            multi-step graph); 1 runs one step per batch.
        max_multi_step_seqs: the largest batch that may run several steps at once.

    Since prefills are not chunked, a sequence of ``max_model_len`` tokens must fit in one
    step, so ``max_num_batched_tokens >= max_model_len`` is required.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_decode_steps: int = 1
    max_multi_step_seqs: int = 1

    def __post_init__(self) -> None:
        names = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_decode_steps")
        for name in (*names, "max_multi_step_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): prefills are not chunked, so a "
                "preempted sequence must be recomputable in one step"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so a full decode batch fits in one step"
            )


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """The sequences of one step.

    For a prefill, each sequence computes positions ``num_computed_tokens .. num_tokens-1``;
    for a decode, each computes its last position ``num_tokens-1``. Either way every
    sequence then samples one token. A decode with ``num_steps > 1`` repeats that
    ``num_steps`` times, greedily, feeding each token back. Block tables already cover all
    computed positions. ``num_scheduled_tokens`` is the total number of positions computed,
    fixed at scheduling.
    """

    seqs: tuple[Sequence, ...]
    is_prefill: bool
    num_scheduled_tokens: int
    num_steps: int = 1

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def step_input(self) -> StepInput:
        """What the workers compute for this batch: plain data, no ``Sequence`` objects."""
        seqs = []
        for seq in self.seqs:
            if self.is_prefill:
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
        return StepInput(tuple(seqs), self.is_prefill)
