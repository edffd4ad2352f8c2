"""The fused speculative rounds' host side (``spec_rounds.py``): a batch's arrays to stage before
a replay, and the replay's one host copy read back into ``SeqOutput``s.

The copy holds, in order: every round's emitted tokens (int [M, n, k + 1], -1 past the last),
their counts [M, n], then (where some row asked) the packed logprobs of every verified position
[M * n * (k + 1), w].
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from dormant.core.step_input import SeqInput
from dormant.core.step_output import SeqOutput, StepOutput, TokenLogprobs
from dormant.worker.logprobs import unpack_logprobs


def round_arrays(seqs: SequenceOf[SeqInput], null_block: int) -> list[np.ndarray]:
    """Each row's newest token, its position, and its block table (flattened, padded with
    ``null_block`` to the widest row's)."""
    n = len(seqs)
    width = max(len(s.block_table) for s in seqs)
    tables = np.full((n, width), null_block, np.int64)
    for row, seq in enumerate(seqs):
        tables[row, : len(seq.block_table)] = seq.block_table
    newest = np.fromiter((s.token_ids[0] for s in seqs), np.int64, n)
    positions = np.fromiter((s.start_position for s in seqs), np.int64, n)
    return [newest, positions, tables.reshape(-1)]


def round_outputs(
    host: np.ndarray,
    seqs: SequenceOf[SeqInput],
    num_rounds: int,
    width: int,
    logprob_width: int | None,
    lag: int,
) -> StepOutput:
    """Each row's tokens over the rounds, in order (``width = k + 1``; ``logprob_width``: the
    packed logprobs' columns, None where none were copied), and its draft's exact positions:
    all but the newest token's (a draft model's, ``lag`` 0), or up to the last round's start
    (MTP's, lag 1: ``spec_outputs.draft_computed``)."""
    m, n, w = num_rounds, len(seqs), width
    end = m * n * w
    tokens = host[:end].reshape(m, n, w)
    counts = host[end : end + m * n].reshape(m, n)
    end += m * n
    entries = None
    if logprob_width is not None:
        entries = unpack_logprobs(host[end:].reshape(m * n * w, logprob_width))
    outputs, round_counts = [], counts.T.tolist()
    for row, seq in enumerate(seqs):
        emitted: list[int] = []
        row_logprobs: list[TokenLogprobs] | None = None
        if entries is not None and seq.params.logprobs is not None:
            row_logprobs = []
        for round_, count in enumerate(round_counts[row]):
            emitted += tokens[round_, row, :count].tolist()
            if row_logprobs is not None and entries is not None:
                first = (round_ * n + row) * w
                row_logprobs += entries[first : first + count]
        computed = seq.start_position + len(emitted)  # the newest token's is missing
        if lag:
            computed -= round_counts[row][-1]  # the last round's start
        lps = None if row_logprobs is None else tuple(row_logprobs)
        outputs.append(SeqOutput(tuple(emitted), lps, None, computed))
    return StepOutput(tuple(outputs), tuple(map(tuple, round_counts)))


__all__ = ["round_arrays", "round_outputs"]
