"""A speculative step's results on the host: its one host copy read back into ``SeqOutput``s.

The copy holds, in order (``spec_step.py`` writes it): the drafting rows' emitted tokens
(int [n_spec, k_max + 1], -1 past the last), their counts [n_spec], the plain rows' tokens
[n_plain], then the packed logprobs of the drafting rows' verified positions, of the plain rows,
and the prompt logprobs, each where some row asked.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from dormant.core.step_input import SeqInput
from dormant.core.step_output import SeqOutput, StepOutput, TokenLogprobs
from dormant.worker.logprobs import unpack_logprobs
from dormant.worker.spec_inputs import SpecLayout


def draft_computed(seq: SeqInput, num_emitted: int, lag: int) -> int:
    """The row's positions with exact draft KV after the step: a draft model's catch-up
    reached the row's end, and its chained passes (the last draft's included) hold the
    accepted drafts' KV; MTP's (``lag = 1``) reached ``start_position`` (its chained passes used
    its own hidden states)."""
    if lag:
        return seq.start_position
    return seq.seq_len + num_emitted - 1


def read_outputs(
    host: np.ndarray,
    seqs: SequenceOf[SeqInput],
    layout: SpecLayout,
    logprob_widths: list[int | None],
    prompt_width: int | None,
    lag: int,
) -> StepOutput:
    """One ``SeqOutput`` per row of ``seqs``, in row order, from the step's host copy.
    ``logprob_widths``: the packed widths of the drafting and the plain rows' logprobs (None:
    not copied)."""
    num_spec, num_plain = len(layout.spec_rows), len(layout.plain_rows)
    width = layout.max_drafts + 1
    end = num_spec * width
    emitted = host[:end].reshape(num_spec, width).tolist()
    counts = host[end : end + num_spec].tolist()
    end += num_spec
    plain_tokens = host[end : end + num_plain].tolist()
    end += num_plain
    entries: list[list[TokenLogprobs] | None] = []
    for packed_width, rows in zip(logprob_widths, (num_spec * width, num_plain), strict=True):
        if packed_width is None:
            entries.append(None)
            continue
        size = rows * packed_width
        entries.append(unpack_logprobs(host[end : end + size].reshape(rows, packed_width)))
        end += size
    spec_entries, plain_entries = entries
    prompt_entries = [] if prompt_width is None else unpack_logprobs(
        host[end:].reshape(-1, prompt_width)
    )  # fmt: skip
    outputs: list[SeqOutput | None] = [None] * len(seqs)
    for n, row in enumerate(layout.spec_rows):
        seq, count = seqs[row], counts[n]
        lps = None
        if spec_entries is not None and seq.params.logprobs is not None:
            lps = tuple(spec_entries[n * width : n * width + count])
        computed = draft_computed(seq, count, lag)
        outputs[row] = SeqOutput(tuple(emitted[n][:count]), lps, None, computed)
    next_prompt = 0
    for n, row in enumerate(layout.plain_rows):
        seq = seqs[row]
        lps = None
        if plain_entries is not None and seq.params.logprobs is not None:
            lps = (plain_entries[n],)
        seq_prompt = None
        if seq.compute_prompt_logprobs:
            count = len(seq.token_ids) - 1
            seq_prompt = tuple(prompt_entries[next_prompt : next_prompt + count])
            next_prompt += count
        computed = draft_computed(seq, 1, lag)
        outputs[row] = SeqOutput((plain_tokens[n],), lps, seq_prompt, computed)
    return StepOutput(tuple(o for o in outputs if o is not None))


def with_draft_computed(output: StepOutput, computed: list[int]) -> StepOutput:
    """``output`` with each row's ``num_draft_computed_tokens`` set."""
    return StepOutput(
        tuple(
            o._replace(num_draft_computed_tokens=c)
            for o, c in zip(output.seqs, computed, strict=True)
        )
    )
