"""``PendingStep`` and ``HostCopies``: launches read back later (async scheduling). Two launches
may be unread at once; a third reuses the first one's host buffer only after reading it."""

from __future__ import annotations

import torch

from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput
from dormant.worker.pending_step import HostCopies, PendingStep

ROW = SeqInput((1,), 0, (0,), SamplingParams(temperature=0.0), seed=0, num_output_tokens=0)


def launch(copies: HostCopies, tokens: list[int]) -> PendingStep:
    return copies.start([torch.tensor(tokens)], (ROW,) * len(tokens), 1, (None, None))


def test_each_launch_reads_back_its_own_tokens_whatever_came_after() -> None:
    copies = HostCopies(torch.device("cpu"))
    first, second = launch(copies, [1, 2]), launch(copies, [3, 4])
    assert not first.is_read
    third = launch(copies, [5, 6])  # first's buffer: first is read before it is overwritten
    assert first.is_read
    assert [s.token_ids for s in first.result().seqs] == [(1,), (2,)]
    assert [s.token_ids for s in second.result().seqs] == [(3,), (4,)]
    assert [s.token_ids for s in third.result().seqs] == [(5,), (6,)]
    assert first.result() is first.result()  # read once


def test_a_launch_that_ran_to_its_results_is_read() -> None:
    output = launch(HostCopies(torch.device("cpu")), [9]).result()
    done = PendingStep.done(output)
    assert done.is_read and done.result() is output
