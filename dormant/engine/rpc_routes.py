"""Where ``LLMEngine.collective_rpc`` sends a method, and what each kind returns (one result per
rank, in rank order, as vLLM's)::

    method                                   goes to                          returns, per rank
    ───────────────────────────────────────  ───────────────────────────────  ─────────────────────
    "sleep", "wake_up"                       the engine's own ``sleep`` /     its ``RankSleepState``
                                             ``wake_up`` (its sleep state's
                                             owner sees the change)
    "reload_weights", "update_weights"       the engine's refits              the names it wrote
    another built-in (``PUBLIC_RPC``)        every rank, as that command      the command's result
    a ``worker_extension_cls`` method's      every rank, as the caller's      the method's result
    name, or a callable ``fn(worker, ...)``  code (a callable pickled by
                                             value to worker processes)

The caller's code may write weights or KV memory by any means, so the prefix cache is dropped
after it, whether it succeeded or failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dormant.core.commands import PUBLIC_RPC, Command
from dormant.engine.calls_in_flight import DrainingExecutor
from dormant.engine.refits import WeightRefits
from dormant.engine.sleep_control import SleepControl


@dataclass(frozen=True)
class RpcRoutes:
    """One engine's routes: its executor that drains the calls in flight first (``commands``),
    its refits and sleep state, and its own sleep, wake, refit and prefix-cache methods."""

    commands: DrainingExecutor
    refits: WeightRefits
    sleep_control: SleepControl
    sleep: Callable[..., Any]
    wake_up: Callable[..., Any]
    reload_weights: Callable[..., list[tuple[str, ...]]]
    update_weights: Callable[..., list[tuple[str, ...]]]
    reset_prefix_cache: Callable[[], bool]

    def route(
        self, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        """Runs ``method`` as the table above says."""
        if callable(method) or method not in PUBLIC_RPC:
            try:
                return self.refits.run_callers_code(method, args, kwargs)
            finally:
                self.reset_prefix_cache()
        command = PUBLIC_RPC[method]
        if command is Command.SLEEP:
            self.sleep(*args, **kwargs)
            return list(self.sleep_control.ranks)
        if command is Command.WAKE_UP:
            self.wake_up(*args, **kwargs)
            return list(self.sleep_control.ranks)
        if command is Command.RELOAD_WEIGHTS:
            return self.reload_weights(*args, **kwargs)
        if command is Command.UPDATE_WEIGHTS:
            return self.update_weights(*args, **kwargs)
        return self.commands.run(command, *args, **kwargs)
