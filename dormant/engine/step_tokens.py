"""A batch's sampled tokens, appended to its sequences up to the token that finishes each one.

The rows of a batch, in order: a row records the KV its step computed (the drafts it verified
excepted), and one whose chunk ended before its sequence's last token appends nothing (what it
sampled is not a token of the sequence). A decode row appends its ``num_steps`` tokens (``1 ..
j + 1`` for a row with ``j`` drafts) one by one, each checked against vLLM's stop rules
(``stopping.finish_reason``) and the caller's stop strings (``TokenHook``); the tokens after the
one that finishes it are dropped. Rows whose sequence finished since the batch was scheduled
(aborted) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

from dormant.engine import stopping
from dormant.engine.batch import ScheduledBatch
from dormant.engine.sequence import FinishReason, Sequence, SequenceStatus

# Called for each token appended, after the token-level stop checks: (sequence, token id,
# whether the token itself stops the sequence) -> the stop string the text now ends with, or
# None. The engine's output processor detokenizes there.
TokenHook = Callable[[Sequence, int, bool], str | None]
# Finishes a sequence: (sequence, reason, stop reason).
Finish = Callable[[Sequence, FinishReason, int | str | None], None]


class StopRules:
    """vLLM's stop rules for one batch's tokens: length, EOS, stop tokens, and the stop strings
    ``on_token`` reports; ``finish`` finishes a sequence that stops."""

    def __init__(
        self,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        on_token: TokenHook | None,
        finish: Finish,
    ) -> None:
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.on_token, self.finish = on_token, finish

    def apply(self, seq: Sequence, token_id: int) -> bool:
        """Finishes ``seq`` if its newest token ``token_id`` stops it; returns whether it did."""
        reason, stop_token_id = stopping.finish_reason(
            seq, token_id, self.eos_token_ids, self.max_model_len
        )
        stop_reason: int | str | None = stop_token_id
        if self.on_token is not None:
            stop_string = self.on_token(seq, token_id, reason is FinishReason.STOP)
            if stop_string is not None:
                reason, stop_reason = FinishReason.STOP, stop_string
        if reason is None:
            return False
        self.finish(seq, reason, stop_reason)
        return True


def append_step_tokens(
    batch: ScheduledBatch,
    token_ids: list[list[int]],
    stops: StopRules,
    draft_computed: SequenceOf[int | None] | None = None,
) -> list[Sequence]:
    """Appends ``token_ids[i]`` to ``batch.seqs[i]`` (see the module docstring); returns the
    sequences that finished, in batch order. ``draft_computed[i]`` (speculative decoding) is
    the row's new ``num_draft_computed_tokens``."""
    finished: list[Sequence] = []
    num_drafts = batch.num_draft_tokens
    rows = zip(batch.seqs, batch.num_new_tokens, token_ids, strict=True)
    for row, (seq, num_new, tokens) in enumerate(rows):
        if seq.is_finished:
            continue
        seq.num_computed_tokens += (num_new - num_drafts[row]) if num_drafts else num_new
        num_draft_computed = None if draft_computed is None else draft_computed[row]
        if num_draft_computed is not None:
            seq.num_draft_computed_tokens = num_draft_computed
        if seq.num_computed_tokens < seq.num_tokens:
            continue  # a chunk of its prompt: what it sampled is not a token of it
        # Per token (up to num_steps a row): Sequence's properties read directly.
        num_prompt, outputs = len(seq.prompt_token_ids), seq.output_token_ids
        for token_id in tokens:
            if seq.status is SequenceStatus.FINISHED:
                break
            seq.num_computed_tokens = num_prompt + len(outputs)  # its num_tokens
            outputs.append(token_id)  # append_token: the check above is its own
            if stops.apply(seq, token_id):
                finished.append(seq)
    return finished
