"""What one engine step returns from the workers: plain, picklable data, one entry per sequence
of the ``StepInput``, in the same order.

Logprobs follow vLLM's shape once the driver has them: for each sampled token, the sampled
token's own logprob and rank (1 = most likely) first, then the top ``k`` tokens. The worker
computes them on the device inside the step and brings them back in the step's one
event-guarded device-to-host copy, together with the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """The logprobs at one position: ``token_ids[0]`` is the sampled (or, for prompt logprobs,
    the actual next) token, followed by the top-k; ``logprobs`` and ``ranks`` align with it.
    (A named tuple: one is made per row per step on the host, at half a frozen dataclass's
    cost.)"""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]


class SeqOutput(NamedTuple):
    """One sequence's share of a step.

    ``token_ids`` holds one sampled token per decode step run (one, or ``num_steps`` for the
    fused multi-step graph). ``logprobs`` is None unless the request asked for them; else it has
    one entry per token in ``token_ids`` (a tuple, or the ``RowLogprobs`` of a decode step's
    ``PackedLogprobs``: a sequence that makes each entry when read). ``prompt_logprobs`` is None
    unless asked for; else it has one entry per prompt position this step computed whose next
    token is known.

    With speculative decoding, a row with ``j`` drafts returns ``1 .. j + 1`` tokens (its
    accepted drafts, then the target's own token), and every row returns
    ``num_draft_computed_tokens``: the positions whose draft KV is now exact (the next step's
    draft starts there). None without speculation.

    (A named tuple, as ``TokenLogprobs``: one is made per row per step on the host, and
    ``tuple.__new__`` makes them without a Python frame; ``_replace`` gives a changed copy.)
    """

    token_ids: tuple[int, ...]
    logprobs: SequenceOf[TokenLogprobs] | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    num_draft_computed_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Each row's ``SeqOutput``. ``round_counts``: speculative rounds run in one call
    (``worker/spec_rounds.py``), each row's emitted count per round (None otherwise)."""

    seqs: tuple[SeqOutput, ...]
    round_counts: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def from_token_ids(cls, token_ids: list[list[int]]) -> StepOutput:
        """An output with tokens only (no logprobs), one list per sequence."""
        return cls(tuple(SeqOutput(tuple(tokens)) for tokens in token_ids))
