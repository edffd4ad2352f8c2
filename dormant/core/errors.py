"""Typed errors of the engine. Each says what was wrong, the engine's state, and what to do."""

from __future__ import annotations

from dormant.errors import EngineError  # the root; dormant.engine re-exports it
from dormant.memory.errors import SleepConflictError


class EngineAsleepError(EngineError):
    """A call needs memory (or scheduling) that is asleep."""


class WeightsNotLoadedError(EngineAsleepError):
    """The weights were discarded (level-2 sleep) and not all of them were refit since.

    vLLM generates garbage here (#29341); dormant refuses.
    """


class SleepLevelConflictError(EngineError, SleepConflictError):
    """``sleep(level)`` on an engine already asleep at another level."""


class RankStateMismatchError(EngineError):
    """Tensor-parallel ranks report different sleep states (after a failure on some of them)."""


class SleepModeDisabledError(EngineError):
    """``sleep`` on an engine built with ``enable_sleep_mode=False``."""


class UnknownRpcMethodError(EngineError, ValueError):
    """``collective_rpc`` named a method that is not on the worker's allowlist."""


class EngineDeadError(EngineError):
    """A worker process died or stopped answering; the engine was shut down."""


class EngineGenerateError(EngineError):
    """vLLM's: one ``AsyncLLM.generate`` request failed while the engine ran it (the cause is
    chained); the request was aborted and the engine still serves others."""


class DuplicateRequestIdError(EngineError, ValueError):
    """``generate`` named a request id that is still running; nothing was queued."""


class InvalidSamplingParamsError(EngineError, ValueError):
    """A ``SamplingParams`` field has a value vLLM refuses too; nothing was queued."""


class UnsupportedOptionError(EngineError, ValueError):
    """A vLLM option (of ``LLM(...)``) or feature has a value dormant cannot honour."""


class UnsupportedSamplingParamsError(InvalidSamplingParamsError, UnsupportedOptionError):
    """A request uses a vLLM sampling feature dormant does not implement (structured outputs,
    logits processors); it is refused, never run without the feature."""
