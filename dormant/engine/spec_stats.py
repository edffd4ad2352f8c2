"""Speculative decoding's counts, per request and for the whole engine, in vLLM's terms
(``vllm/v1/spec_decode/metrics.py``): a *draft* is one step of one sequence that verified
``num_draft_tokens > 0`` proposed tokens, of which the first ``num_accepted_tokens`` matched.

The counts are the worker's verification, before the scheduler cuts a sequence at its stop:
tokens accepted past a stop still count as accepted (as vLLM counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Drafts verified, tokens proposed and accepted; ``num_accepted_tokens_per_pos[i]`` counts
    drafts whose token ``i`` (0-based) was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One draft of ``num_draft_tokens`` tokens whose first ``num_accepted_tokens`` were
        accepted. Precondition: ``0 <= num_accepted_tokens <= num_draft_tokens``, ``>= 1``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted_tokens):
            per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed tokens (None before any draft)."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per draft step: 1 (the target's own token) + the accepted drafts."""
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )
