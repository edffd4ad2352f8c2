"""Typed errors of the engine. Each says what was wrong, the engine's state, and what to do."""

from __future__ import annotations

from dormant.memory.errors import SleepConflictError


class EngineError(RuntimeError):
    """Base class of the engine's errors."""


class EngineAsleepError(EngineError):
    """A call needs memory (or scheduling) that is asleep."""


class WeightsNotLoadedError(EngineAsleepError):
    """The weights were discarded (level-2 sleep) and not all of them were refit since.

    vLLM generates garbage here (#29341); dormant refuses.
    """


class SleepLevelConflictError(EngineError, SleepConflictError):
    """``sleep(level)`` on an engine already asleep at another level."""


class SleepModeDisabledError(EngineError):
    """``sleep`` on an engine built with ``enable_sleep_mode=False``."""


class UnknownRpcMethodError(EngineError, ValueError):
    """``collective_rpc`` named a method that is not on the worker's allowlist."""


class EngineDeadError(EngineError):
    """A worker process died or stopped answering; the engine was shut down."""
