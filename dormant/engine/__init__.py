"""``dormant.engine``: a compact vLLM-style engine built on ``dormant.memory``."""

from dormant.core.config import EngineConfig
from dormant.core.errors import (
    EngineAsleepError,
    EngineDeadError,
    EngineError,
    SleepLevelConflictError,
    SleepModeDisabledError,
    UnknownRpcMethodError,
    WeightsNotLoadedError,
)
from dormant.core.sampling_params import SamplingParams
from dormant.engine.llm import LLM
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import CompletionOutput, RequestOutput

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineAsleepError",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SleepLevelConflictError",
    "SleepModeDisabledError",
    "UnknownRpcMethodError",
    "WeightsNotLoadedError",
]
