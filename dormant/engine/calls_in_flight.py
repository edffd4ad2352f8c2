"""The engine's model calls in flight, and the worker commands that wait for them.

Without async scheduling a call is read back as soon as it is launched, so at most one is in
flight and only inside ``StepPipeline.step``. With it (``EngineConfig.overlaps_steps``) a step ends
with the next call still running on the device (``engine/successor.py``), and commands arrive
between steps: a sleep, a refit, an extension's method. THE DRAIN RULE: every command the
engine sends its workers first completes the calls in flight (``DrainingExecutor``), so no
command ever meets a step the device is still computing; the requests those calls finished are
returned by the engine's next ``step`` (``LLMEngine.pop_drained_outputs``). Only the commands
that read a rank's bookkeeping and touch no device memory (``READ_ONLY_COMMANDS``: the memory
status a ``/metrics`` scrape asks for, the sleep state, the health check) run beside them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from dormant.core.commands import Command
from dormant.core.step_input import StepInput
from dormant.core.step_output import StepOutput
from dormant.engine.batch import ScheduledBatch
from dormant.executors import Executor
from dormant.worker.pending_step import PendingStep, StepHandle

READ_ONLY_COMMANDS = frozenset({Command.MEMORY_STATUS, Command.SLEEP_STATE, Command.CHECK_HEALTH})


class CallsInFlight:
    """Launched batches and their pending results, oldest first. ``overlaps``: the engine may
    queue a call while another is in flight (``async_scheduling``). Executors with ``launch``
    (one rank in this process, ``UniprocExecutor``; ranks in processes of their own,
    ``MultiprocExecutor``) return before the results, and every call goes through it, so
    calls are seen in one place; other executors' calls run to their results."""

    def __init__(self, executor: Executor, overlaps: bool) -> None:
        self._executor = executor
        self.can_overlap = callable(getattr(executor, "launch", None))
        self._overlaps = overlaps and self.can_overlap
        self._calls: deque[tuple[ScheduledBatch, StepHandle]] = deque()

    @property
    def overlaps(self) -> bool:
        return self._overlaps

    @overlaps.setter
    def overlaps(self, value: bool) -> None:
        if value and not self.can_overlap:
            raise ValueError(
                f"{type(self._executor).__name__}'s calls cannot overlap: they run to their "
                "results (executors with launch: UniprocExecutor, MultiprocExecutor)"
            )
        self._overlaps = value

    def __len__(self) -> int:
        return len(self._calls)

    def launch(self, batch: ScheduledBatch, step: StepInput) -> None:
        multi_step = batch.num_steps > 1  # decodes: the fused multi-step graph
        executor: Any = self._executor
        pending: StepHandle
        if self.can_overlap:  # looked up at each call: tests and benchmarks wrap it
            pending = executor.launch(step, multi_step)
        elif multi_step:
            pending = PendingStep.done(executor.execute_multi_step(step))
        else:
            pending = PendingStep.done(executor.execute(step))
        self._calls.append((batch, pending))

    def oldest(self) -> tuple[ScheduledBatch, StepHandle]:
        return self._calls[0]

    def pop_oldest(self) -> tuple[ScheduledBatch, StepHandle]:
        return self._calls.popleft()

    def clear(self) -> None:
        """Forgets every call (a failed step: the scheduler discards their batches). The device
        may still run them; whatever runs next is queued behind them."""
        self._calls.clear()


class DrainingExecutor:
    """``executor`` whose commands (``run``) each first call ``drain`` (THE DRAIN RULE), but
    ``READ_ONLY_COMMANDS``."""

    def __init__(self, executor: Executor, drain: Callable[[], None]) -> None:
        self._executor, self._drain = executor, drain
        self.world_size = executor.world_size

    def run(self, command: Command, *args: Any, **kwargs: Any) -> list[Any]:
        if command not in READ_ONLY_COMMANDS:
            self._drain()
        return self._executor.run(command, *args, **kwargs)

    def execute(self, step: StepInput) -> StepOutput:
        self._drain()
        return self._executor.execute(step)

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        self._drain()
        return self._executor.execute_multi_step(step)

    def shutdown(self) -> None:
        self._drain()
        self._executor.shutdown()
