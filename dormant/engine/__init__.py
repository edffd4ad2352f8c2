"""``dormant.engine``: a compact vLLM-style engine built on ``dormant.memory``."""

from dormant.engine.config import EngineConfig
from dormant.engine.errors import (
    EngineAsleepError,
    EngineDeadError,
    EngineError,
    SleepLevelConflictError,
    SleepModeDisabledError,
    UnknownRpcMethodError,
    WeightsNotLoadedError,
)
from dormant.engine.llm import LLM
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import CompletionOutput, RequestOutput
from dormant.engine.sampling_params import SamplingParams

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
