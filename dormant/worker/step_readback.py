"""A step's host copy (``logprobs.HostCopy``) read back into its ``StepOutput``.

The host copy holds, in order (int32; float32 values as their bits):

| part                   | shape                 | present when                          |
|------------------------|-----------------------|---------------------------------------|
| tokens                 | [num_steps, n]        | always                                |
| packed logprobs        | [num_steps, n, width] | some row asks for logprobs            |
| packed prompt logprobs | [p, prompt_width]     | some row computes its prompt logprobs |

This runs on the host between two steps, while the device waits for the next one, so its
per-row work is C-level (``tolist``, ``zip``, ``map``): no Python frame runs per row except
``SeqOutput``'s own constructor, and a loop over the rows that compute prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from dormant.core.step_input import SeqInput
from dormant.core.step_output import SeqOutput, StepOutput, TokenLogprobs
from dormant.worker.logprobs import unpack_logprobs


def read_step_output(
    host: np.ndarray,
    seqs: SequenceOf[SeqInput],
    num_steps: int,
    width: int | None,
    prompt_width: int | None,
) -> StepOutput:
    """The ``StepOutput`` of ``seqs`` from ``host`` (laid out as the table above; ``width``
    and ``prompt_width`` are the packed rows' widths, None when that part is absent: no row
    asked for logprobs, no row computes its prompt logprobs).

    A row's logprobs are reported only when its request asked for them (``params.logprobs``),
    and its prompt logprobs only when it computed them (``compute_prompt_logprobs``): one
    entry per token of its chunk but the last, in row order.
    """
    num_seqs = len(seqs)
    end = num_steps * num_seqs
    # One tuple of num_steps tokens per row: zip(*) transposes the step-major rows in C.
    token_ids = list(zip(*host[:end].reshape(num_steps, num_seqs).tolist(), strict=True))
    logprobs: list[tuple[TokenLogprobs, ...] | None] = [None] * num_seqs
    if width is not None:
        packed = host[end : end + end * width].reshape(-1, width)
        end += packed.size
        per_token = unpack_logprobs(packed)  # step-major: [step * num_seqs + row]
        steps = [per_token[s * num_seqs : (s + 1) * num_seqs] for s in range(num_steps)]
        per_row: list[tuple[TokenLogprobs, ...] | None] = list(zip(*steps, strict=True))
        wants = [s.params.logprobs is not None for s in seqs]
        logprobs = (
            per_row
            if all(wants)
            else [e if w else None for e, w in zip(per_row, wants, strict=True)]
        )
    prompt_logprobs: list[tuple[TokenLogprobs, ...] | None] = [None] * num_seqs
    if prompt_width is not None:  # else no row computed prompt logprobs (decode steps)
        entries = unpack_logprobs(host[end:].reshape(-1, prompt_width))
        next_entry = 0
        for row, seq in enumerate(seqs):
            if seq.compute_prompt_logprobs:
                count = len(seq.token_ids) - 1
                prompt_logprobs[row] = tuple(entries[next_entry : next_entry + count])
                next_entry += count
    return StepOutput(tuple(map(SeqOutput, token_ids, logprobs, prompt_logprobs)))
