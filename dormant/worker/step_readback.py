"""A step's host copy (``logprobs.HostCopy``) read back into its ``StepOutput``.

The host copy holds, in order (int32; float32 values as their bits):

| part                   | shape                 | present when                          |
|------------------------|-----------------------|---------------------------------------|
| tokens                 | [num_steps, n]        | always                                |
| packed logprobs        | [num_steps, n, width] | some row asks for logprobs            |
| packed prompt logprobs | [p, prompt_width]     | some row computes its prompt logprobs |

This runs on the host between two steps, while the device waits for the next one, so its
per-row work is C-level (``tolist``, ``zip``, ``map``): no Python frame runs per row except
``RowLogprobs``' constructor (rows with logprobs), and a loop over the rows that compute prompt
logprobs. The decode logprobs stay packed (``core/packed_logprobs.py``): a row's
``TokenLogprobs`` are made only when the engine reads them, and its common case does not.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from itertools import repeat

import numpy as np

from dormant.core.packed_logprobs import PackedLogprobs, RowLogprobs, unpack_logprobs
from dormant.core.step_input import SeqInput
from dormant.core.step_output import SeqOutput, StepOutput, TokenLogprobs


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
    logprobs: SequenceOf[RowLogprobs | None] = [None] * num_seqs
    if width is not None:
        packed = host[end : end + end * width].reshape(-1, width)
        end += packed.size
        # A copy: the host buffer is the next step's. No object per token (PackedLogprobs).
        rows = PackedLogprobs(packed.copy(), num_seqs).rows()
        wants = [s.params.logprobs is not None for s in seqs]
        logprobs = (
            rows if all(wants) else [e if w else None for e, w in zip(rows, wants, strict=True)]
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
    # tuple.__new__ makes each named tuple without SeqOutput.__new__'s Python frame.
    fields = zip(token_ids, logprobs, prompt_logprobs, repeat(None))
    return StepOutput(tuple(map(tuple.__new__, repeat(SeqOutput), fields)))
