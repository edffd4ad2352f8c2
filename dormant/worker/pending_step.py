"""A launched step whose results are read later: the device runs it while the host works.

The engine's async scheduling (``engine/step_pipeline.py``) launches step N+1 before it reads step
N back, so two launches may be unread at once. What a launch leaves for its reader is therefore
per launch, not per runner:

- **its host copy**: ``HostCopies`` alternates two ``HostCopy`` buffers, so launch N+1's copy
  never lands in the buffer that launch N's reader has yet to read. A third launch reuses the
  first one's buffer only after reading it (``PendingStep.result`` then returns what it read).
- **its host staging**: every launch writes the runner's host staging arrays (input buffers,
  graph sampling rows, penalties) and copies them to the device without blocking. Before the
  next launch writes them again, it waits for the previous launch's copies (``StagingFence``),
  which the device runs first in stream order: in the pipelined steady state they ran while
  the host read the launch before, so the wait is short.

Device buffers need no guard: every launch runs on one stream, so step N+1's copies into the
static input buffers run after step N's graph has read them.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Protocol

import torch

from dormant.core.step_input import SeqInput
from dormant.core.step_output import StepOutput
from dormant.worker.logprobs import HostCopy
from dormant.worker.step_readback import read_step_output


class StepHandle(Protocol):
    """A launched step, as the engine holds it: an in-process rank's ``PendingStep``, or the
    replies of ranks in other processes (``executors/multiproc.RemoteStep``)."""

    def result(self) -> StepOutput: ...


class PendingStep:
    """One launch's results: ``result()`` waits for its host copy (once) and reads it back."""

    __slots__ = ("_copy", "_num_steps", "_output", "_seqs", "_widths")

    def __init__(
        self,
        copy: HostCopy | None,
        seqs: SequenceOf[SeqInput],
        num_steps: int,
        widths: tuple[int | None, int | None] = (None, None),
        output: StepOutput | None = None,
    ) -> None:
        self._copy, self._seqs, self._num_steps, self._widths = copy, seqs, num_steps, widths
        self._output = output

    @classmethod
    def done(cls, output: StepOutput) -> PendingStep:
        """A launch that ran to its results already (single steps feeding tokens back)."""
        return cls(None, (), 0, output=output)

    @property
    def is_read(self) -> bool:
        return self._output is not None

    def result(self) -> StepOutput:
        """Waits for the launch's host copy, then its ``StepOutput`` (the same one every call).
        Its widths are the packed logprobs' and prompt logprobs' (None: that part is absent)."""
        if self._output is None:
            assert self._copy is not None
            width, prompt_width = self._widths
            self._output = read_step_output(
                self._copy.wait(), self._seqs, self._num_steps, width, prompt_width
            )
        return self._output


class HostCopies:
    """Two host copies used in turn, each owned by the last launch that started it."""

    def __init__(self, device: torch.device) -> None:
        self._copies = (HostCopy(device), HostCopy(device))
        self._owners: list[PendingStep | None] = [None, None]
        self._next = 0

    def start(
        self,
        parts: list[torch.Tensor],
        seqs: SequenceOf[SeqInput],
        num_steps: int,
        widths: tuple[int | None, int | None],
    ) -> PendingStep:
        """Starts the copy of ``parts`` in the next buffer; returns the launch that reads it.
        The buffer's previous owner, if still unread, is read first."""
        index = self._next
        self._next = 1 - index
        owner = self._owners[index]
        if owner is not None and not owner.is_read:
            owner.result()  # its values leave the buffer before the new copy lands there
        copy = self._copies[index]
        copy.start(parts)
        pending = PendingStep(copy, seqs, num_steps, widths)
        self._owners[index] = pending
        return pending


class StagingFence:
    """Marks when a launch's host-to-device copies have run, so the next launch may overwrite
    the host staging they read (CUDA; on the CPU every copy has run when it returns)."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._is_recorded = False

    def wait(self) -> None:
        """Before writing host staging: the previous launch's copies from it have run."""
        if self._event is not None and self._is_recorded:
            self._event.synchronize()

    def record(self) -> None:
        """After a launch's last copy from host staging is queued."""
        if self._event is not None:
            self._event.record()
            self._is_recorded = True
