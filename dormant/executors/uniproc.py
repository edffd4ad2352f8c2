"""``UniprocExecutor``: the single rank hosted in this process."""

from __future__ import annotations

from typing import Any

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.core.step_input import StepInput
from dormant.core.step_output import StepOutput
from dormant.worker.pending_step import PendingStep
from dormant.worker.worker import Worker, create_worker


class WorkerWrapper:
    """vLLM's ``driver_worker``: the worker as ``.worker``, and its attributes directly, so both
    ``driver_worker.worker.model_runner.model`` and TRL's ``driver_worker.model_runner.model``
    reach the model object."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


class UniprocExecutor:
    """Hosts one worker in this process (by default the only rank)."""

    world_size = 1  # the ranks this executor talks to: its own

    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        self.worker = worker or create_worker(config)
        self.driver_worker = WorkerWrapper(self.worker)

    def run(self, command: Command, *args: Any, **kwargs: Any) -> list[Any]:
        return [self.worker.handle(command, *args, **kwargs)]

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        return self.worker.execute_multi_step(step)

    def launch(self, step: StepInput, multi_step: bool = False) -> PendingStep:
        """Queues the step without waiting for its results (``Worker.launch``): an in-process
        rank's steps can overlap the engine's host work, which async scheduling uses."""
        return self.worker.launch(step, multi_step)

    def shutdown(self) -> None:
        self.worker.shutdown()
