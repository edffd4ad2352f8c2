"""``M`` speculative rounds as ``M`` single speculative steps, each round's tokens fed back: what
the fused rounds' graph computes (``spec_rounds.py``), for batches it does not fit (random rows,
a draft that trails: MTP's first decode after a prompt, the CPU without graphs), with the same
results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dormant.core.step_input import SeqInput, StepInput
from dormant.core.step_output import SeqOutput, StepOutput


def next_round(seq: SeqInput, output: SeqOutput) -> SeqInput:
    """The next round's input of a decode row after this round emitted ``output.token_ids``:
    its last token is the newest, and the draft catches up from its
    ``num_draft_computed_tokens`` (a draft model's: none left; MTP's: the tokens after
    ``start_position``). Precondition: the block table covers the row's next positions."""
    tokens = output.token_ids
    start = seq.seq_len + len(tokens) - 1
    computed = output.num_draft_computed_tokens
    assert computed is not None, "a speculative step reports its draft's exact positions"
    known = (*seq.draft_prefix_token_ids, *seq.token_ids, *tokens)  # from draft_start on
    num_output_tokens = seq.num_output_tokens + len(tokens)
    outputs = seq.output_token_ids
    return dataclasses.replace(
        seq,
        token_ids=(tokens[-1],),
        start_position=start,
        num_output_tokens=num_output_tokens,
        output_token_ids=None if outputs is None else (*outputs, *tokens),
        masked_stop_token_ids=(
            seq.masked_stop_token_ids if num_output_tokens < seq.params.min_tokens else ()
        ),
        compute_prompt_logprobs=False,
        draft_prefix_token_ids=known[computed - seq.draft_start : start - seq.draft_start],
    )


def run_rounds_singly(
    execute: Callable[[StepInput], StepOutput], step: StepInput, num_rounds: int
) -> StepOutput:
    """``num_rounds`` speculative steps of ``step``'s decode rows with ``execute``; per row the
    tokens (and logprobs, where asked) of every round, in order, and the last round's
    ``num_draft_computed_tokens``."""
    seqs, rounds = step.seqs, []
    for _ in range(num_rounds):
        outputs = execute(StepInput(seqs, is_prefill=False)).seqs
        rounds.append(outputs)
        seqs = tuple(next_round(s, o) for s, o in zip(seqs, outputs, strict=True))
    merged, counts = [], []
    for per_round in zip(*rounds, strict=True):
        tokens = tuple(t for o in per_round for t in o.token_ids)
        logprobs = None
        if per_round[0].logprobs is not None:
            logprobs = tuple(entry for o in per_round for entry in o.logprobs or ())
        computed = per_round[-1].num_draft_computed_tokens
        merged.append(SeqOutput(tokens, logprobs, None, computed))
        counts.append(tuple(len(o.token_ids) for o in per_round))
    return StepOutput(tuple(merged), tuple(counts))


__all__ = ["next_round", "run_rounds_singly"]
