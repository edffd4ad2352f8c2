"""Which decode rows verify drafts, and how many: the driver's half of speculative decoding.

A decode of ``seq`` (``L = num_tokens``, its newest token at position ``L - 1``) with ``j``
drafts computes positions ``L - 1 .. L - 1 + j`` and emits ``1 .. j + 1`` tokens, so

    j = min(k, max_tokens - num_output_tokens - 1, max_model_len - L - 1)

keeps every emitted token within ``max_tokens`` and ``max_model_len`` (none is made only to
be dropped) and every computed position inside the block table. Rows whose sampling needs a
logits processor (penalties, bad words, the ``min_tokens`` mask) verify none: they are plain
decodes, exactly as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from dormant.core.step_output import StepOutput
from dormant.engine import stopping
from dormant.engine.batch import SchedulerConfig
from dormant.engine.sequence import Sequence
from dormant.engine.spec_stats import SpecDecodeStats


def is_eligible(seq: Sequence) -> bool:
    """Whether ``seq``'s next tokens are sampled with no logits processor."""
    params = seq.params
    return (
        params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.bad_words_token_ids
        and seq.num_output_tokens >= params.min_tokens
    )


def num_drafts(seq: Sequence, config: SchedulerConfig) -> int:
    """Drafts the next decode of ``seq`` may verify (see the module docstring)."""
    if not config.num_speculative_tokens or not is_eligible(seq):
        return 0
    max_len = config.max_model_len
    left = stopping.max_tokens(seq, max_len) - seq.num_output_tokens - 1
    return max(0, min(config.num_speculative_tokens, left, max_len - seq.num_tokens - 1))


def record_step(
    seqs: SequenceOf[Sequence],
    num_draft_tokens: SequenceOf[int],
    output: StepOutput,
    total: SpecDecodeStats,
) -> None:
    """Counts each row that verified drafts into its sequence's stats and ``total``: a row with
    ``j`` drafts returned ``1 + accepted`` tokens per round (``output.round_counts``: each
    round's count, when it ran several; else one round, all its tokens)."""
    rounds = output.round_counts
    for row, (seq, count, seq_output) in enumerate(
        zip(seqs, num_draft_tokens, output.seqs, strict=True)
    ):
        if not count:
            continue
        if seq.spec_decode_stats is None:
            seq.spec_decode_stats = SpecDecodeStats()
        emitted = (len(seq_output.token_ids),) if rounds is None else rounds[row]
        for num_emitted in emitted:
            seq.spec_decode_stats.record(count, num_emitted - 1)
            total.record(count, num_emitted - 1)
