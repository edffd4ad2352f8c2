"""Executors run commands on every worker. ``UniprocExecutor`` hosts the single rank in-process;
``MultiprocExecutor`` (``dormant.distributed``) runs one process per tensor-parallel rank."""

from __future__ import annotations

from typing import Any, Protocol

from dormant.engine.commands import Command
from dormant.engine.config import EngineConfig
from dormant.engine.step_input import StepInput
from dormant.engine.worker import Worker


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


class UniprocExecutor:
    """Hosts one worker in this process (by default the only rank)."""

    world_size = 1  # the ranks this executor talks to: its own

    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        self.worker = worker or Worker(config)

    def run(self, command: Command, *args: Any, **kwargs: Any) -> list[Any]:
        return [self.worker.handle(command, *args, **kwargs)]

    def execute(self, step: StepInput) -> list[int]:
        return self.worker.execute(step)

    def execute_multi_step(self, step: StepInput) -> list[list[int]]:
        return self.worker.execute_multi_step(step)

    def shutdown(self) -> None:
        self.worker.shutdown()


def make_executor(config: EngineConfig) -> Executor:
    """In-process for one rank; one process per rank ("mp"); or this process as one rank of a
    ``torchrun`` launch ("external_launcher")."""
    backend = config.distributed_executor_backend
    if backend == "external_launcher":
        from dormant.distributed.executor import ExternalLauncherExecutor

        return ExternalLauncherExecutor(config)
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(config)
    from dormant.distributed.executor import MultiprocExecutor

    return MultiprocExecutor(config)
