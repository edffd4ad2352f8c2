"""What every executor offers the engine: typed commands run on every rank, results in rank
order. ``UniprocExecutor`` (one rank, in-process), ``MultiprocExecutor`` (one process per rank)
and ``ExternalLauncherExecutor`` (this process is one rank of a ``torchrun`` launch) implement it.
"""

from __future__ import annotations

from typing import Any, Protocol

from dormant.core.commands import Command
from dormant.core.step_input import StepInput


class Executor(Protocol):
    world_size: int

    def run(self, command: Command, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs ``command`` on every rank; returns the results in rank order."""
        ...

    def execute(self, step: StepInput) -> list[int]:
        """Runs one model step on every rank; returns the sampled tokens (rank 0's)."""
        ...

    def execute_multi_step(self, step: StepInput) -> list[list[int]]:
        """Runs the fused multi-step graph on every rank; returns each sequence's tokens."""
        ...

    def shutdown(self) -> None: ...
