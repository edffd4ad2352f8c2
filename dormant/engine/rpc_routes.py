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
from typing import TYPE_CHECKING, Any

from dormant.core.commands import PUBLIC_RPC, Command
from dormant.engine.calls_in_flight import DrainingExecutor

if TYPE_CHECKING:
    from dormant.engine.llm_engine import LLMEngine


def route_rpc(
    engine: LLMEngine,
    commands: DrainingExecutor,
    method: str | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> list[Any]:
    """Runs ``method`` as the table above says, commands through ``commands`` (the engine's
    executor that drains the calls in flight first)."""
    if callable(method) or method not in PUBLIC_RPC:
        try:
            return engine.refits.run_callers_code(method, args, kwargs)
        finally:
            engine.reset_prefix_cache()
    command = PUBLIC_RPC[method]
    if command is Command.SLEEP:
        engine.sleep(*args, **kwargs)
        return list(engine.sleep_control.ranks)
    if command is Command.WAKE_UP:
        engine.wake_up(*args, **kwargs)
        return list(engine.sleep_control.ranks)
    if command is Command.RELOAD_WEIGHTS:
        return engine.reload_weights(*args, **kwargs)
    if command is Command.UPDATE_WEIGHTS:
        return engine.update_weights(*args, **kwargs)
    return commands.run(command, *args, **kwargs)
