"""The engine's sleep, pause, release and wake: requests in flight first, then the ranks.

Each call validates against ``SleepControl`` (the one owner of the sleep state, and its rules)
before anything changes, handles the requests in flight by mode (``abort`` finishes them,
``wait`` drains them first, ``keep`` pauses them and, where the KV cache is discarded,
recomputes their KV after the wake), runs the command on every rank and records what the ranks
report. ``LLMEngine`` has one ``EngineSleep`` and forwards its public methods to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.core.errors import SleepModeDisabledError
from dormant.engine.outputs import RequestOutput
from dormant.engine.scheduler import Scheduler
from dormant.engine.sleep_control import SLEEP_MODES, SleepControl, check_release_context
from dormant.executors import Executor
from dormant.memory import KV_CACHE

Finished = Callable[[], list[RequestOutput]]  # a call that returns the requests it finished


class EngineSleep:
    """``scheduler`` returns the engine's scheduler, ``abort_all`` finishes every request
    (``abort_request()``), ``step`` runs one engine step, ``refresh`` fetches every rank's
    sleep state into ``control`` and ``drain`` completes the engine's calls in flight (async
    scheduling); all are looked up at each call, as the engine's own attributes would be.
    ``executor``'s commands drain those calls first (``engine/calls_in_flight.py``)."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        control: SleepControl,
        *,
        scheduler: Callable[[], Scheduler],
        abort_all: Finished,
        step: Finished,
        refresh: Callable[[], None],
        drain: Callable[[], None],
    ) -> None:
        self.config, self.executor, self.control = config, executor, control
        self._scheduler, self._abort_all, self._step = scheduler, abort_all, step
        self._refresh, self._drain = refresh, drain

    def sleep(self, level: int, mode: str, release_context: bool) -> list[RequestOutput]:
        """Sleeps every rank at ``level`` after handling in-flight requests by ``mode`` (level 0
        pauses scheduling only). On a paused engine the pause's choice stands: kept requests
        stay kept. Returns the requests that finished during the call (aborted or drained). A
        conflicting request raises before anything changes (``SleepControl``).

        ``release_context``: the driver then checkpoints what is left of each process's device
        state, its CUDA context included (zero residual; one GPU, no NCCL group); ``wake_up``
        restores it first. Refused before anything changes where it cannot work."""
        self._check_sleep_mode_enabled()
        _check_mode(mode)
        control = self.control
        control.check_sleep(level)
        if release_context:
            check_release_context(level, self.config.tensor_parallel_size)
            self.executor.run(Command.CHECK_RELEASE_CONTEXT)
        if control.is_paused:
            mode = "keep"  # the pause settled the requests already; what it kept stays kept
        elif mode == "wait" and self._scheduler().has_unfinished:
            control.check_can_generate()  # draining needs a runnable engine
        finished = self._settle_requests(mode, discards_kv=level > 0)
        if level > 0:
            release = (None, True) if release_context else ()  # (tags, release_context)
            self._run_sleep_command(Command.SLEEP, level, *release)
        control.asked(level)
        return finished

    def pause(self, mode: str) -> list[RequestOutput]:
        """vLLM's ``pause_generation``: handles in-flight requests by ``mode`` (``keep`` leaves
        them queued) and stops scheduling; memory is untouched. Returns the requests that
        finished (aborted or drained)."""
        _check_mode(mode)
        finished = self._settle_requests(mode, discards_kv=False)
        self.control.asked(0)
        return finished

    def release(self, tags: Sequence[str] | None) -> None:
        """Tag-granular sleep (SGLang's ``release_memory_occupation``): each tag with its
        level-1 policy. Requests in flight are kept; they recompute their KV after wake."""
        if tags is None:
            self.sleep(level=1, mode="keep", release_context=False)
            return
        self._check_sleep_mode_enabled()
        named = self.control.known_tags(tags)
        self.control.check_sleep(1, named)
        self._settle_requests("keep", discards_kv=KV_CACHE in named)
        self._run_sleep_command(Command.SLEEP, 1, named)
        self.control.asked(1)

    def wake_up(self, tags: Sequence[str] | None) -> bool:
        """Wakes ``tags`` (all when None) on every rank; returns whether the engine is now
        fully awake. Unknown tags raise and change nothing.

        vLLM's two tags wake what goes with them (``WAKE_GROUPS``), so its RL sequence
        ``wake_up(["weights"])`` → refit → ``wake_up(["kv_cache"])`` leaves nothing asleep.
        """
        self._run_sleep_command(Command.WAKE_UP, self.control.wake_tags(tags))
        self.control.woke()
        return not self.control.is_sleeping

    def _check_sleep_mode_enabled(self) -> None:
        if not self.config.enable_sleep_mode:
            raise SleepModeDisabledError(
                "sleep and release need LLM(..., enable_sleep_mode=True); this engine was "
                "built without it"
            )

    def _settle_requests(self, mode: str, *, discards_kv: bool) -> list[RequestOutput]:
        """Handles in-flight requests before memory sleeps: ``abort`` finishes them, ``wait``
        runs them to completion, ``keep`` keeps them (recomputing their KV if it is about to
        be discarded). Returns the requests that finished. The calls in flight complete first,
        so the scheduler has none when it preempts."""
        self._drain()
        if not self._scheduler().has_unfinished:
            return []
        if mode == "abort":
            return self._abort_all()
        finished: list[RequestOutput] = []
        if mode == "wait":
            while self._scheduler().has_unfinished:
                finished += self._step()
        elif discards_kv:
            self._scheduler().preempt_all()
        return finished

    def _run_sleep_command(self, command: Command, *args: Any) -> None:
        """Runs a sleep or wake command on every rank and records what they report. If a rank
        fails, every rank's state is fetched first, so the engine's view stays truthful."""
        try:
            states = self.executor.run(command, *args)
        except BaseException:
            self._refresh()
            raise
        self.control.update(states)


def _check_mode(mode: str) -> None:
    if mode not in SLEEP_MODES:
        raise ValueError(f"sleep/pause mode must be one of {SLEEP_MODES}, got {mode!r}")
