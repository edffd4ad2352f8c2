"""What every executor offers the engine: typed commands run on every rank, results in rank
order. ``UniprocExecutor`` (one rank, in-process), ``MultiprocExecutor`` (one process per rank)
and ``ExternalLauncherExecutor`` (this process is one rank of a ``torchrun`` launch) implement it.
"""

from __future__ import annotations

from typing import Any, Protocol

from dormant.core.commands import Command
from dormant.core.step_input import StepInput
from dormant.core.step_output import StepOutput


class Executor(Protocol):
    world_size: int

    def run(self, command: Command, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs ``command`` on every rank; returns the results in rank order."""
        ...

    def execute(self, step: StepInput) -> StepOutput:
        """Runs one model step on every rank; returns rank 0's ``StepOutput`` (every rank
        samples the same tokens): one token per sequence, with the logprobs asked for."""
        ...

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        """Runs ``num_steps`` decode steps on every rank (the fused multi-step graph
        where the batch fits it); returns rank 0's ``StepOutput``, ``num_steps`` tokens and
        their logprobs per sequence."""
        ...

    def shutdown(self) -> None: ...
