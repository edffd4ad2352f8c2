"""``dormant.engine``: a compact vLLM-style engine built on ``dormant.memory``."""

from dormant.core.config import EngineConfig
from dormant.core.errors import (
    EngineAsleepError,
    EngineDeadError,
    EngineError,
    InvalidSamplingParamsError,
    RankStateMismatchError,
    SleepLevelConflictError,
    SleepModeDisabledError,
    UnknownRpcMethodError,
    UnsupportedOptionError,
    UnsupportedSamplingParamsError,
    WeightsNotLoadedError,
)
from dormant.core.sampling_params import RequestOutputKind, SamplingParams
from dormant.engine.async_llm import AsyncLLM
from dormant.engine.block_manager import BlockManagerError
from dormant.engine.llm import LLM
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import CompletionOutput, RequestOutput
from dormant.engine.scheduler import RequestTooLongError, SchedulerError
from dormant.engine.sequence import SequenceFinishedError
from dormant.engine.tokenizer import TokenizerError
from dormant.models.errors import UnsupportedModelError, WeightError
from dormant.worker.extension import WorkerExtensionError
from dormant.worker.transfer_errors import UpdateGroupError, WeightTransferError

__all__ = [
    "LLM",
    "AsyncLLM",
    "BlockManagerError",
    "CompletionOutput",
    "EngineAsleepError",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "InvalidSamplingParamsError",
    "LLMEngine",
    "RankStateMismatchError",
    "RequestOutput",
    "RequestOutputKind",
    "RequestTooLongError",
    "SamplingParams",
    "SchedulerError",
    "SequenceFinishedError",
    "SleepLevelConflictError",
    "SleepModeDisabledError",
    "TokenizerError",
    "UnknownRpcMethodError",
    "UnsupportedModelError",
    "UnsupportedOptionError",
    "UnsupportedSamplingParamsError",
    "UpdateGroupError",
    "WeightError",
    "WeightTransferError",
    "WeightsNotLoadedError",
    "WorkerExtensionError",
]
