"""``dormant.install_as_vllm()``: dormant under vLLM's module names, for code that does
``import vllm`` (TRL, NeMo-RL), the way PyMySQL's ``install_as_MySQLdb()`` serves MySQLdb users.

    >>> import dormant
    >>> dormant.install_as_vllm()     # before the framework imports vllm
    >>> from trl import GRPOTrainer    # its `from vllm import LLM, SamplingParams` gets dormant's

What it registers, all backed by dormant's own classes:

    module                                  names
    ──────────────────────────────────────  ───────────────────────────────────────────────
    vllm                                    LLM, AsyncLLMEngine, SamplingParams, RequestOutput,
                                            CompletionOutput, TokensPrompt, TextPrompt,
                                            EngineArgs, AsyncEngineArgs, __version__
    vllm.sampling_params                    SamplingParams, RequestOutputKind,
                                            StructuredOutputsParams (refused when built)
    vllm.outputs / vllm.logprobs / vllm.inputs   the output, Logprob and prompt types
    vllm.logger                             init_logger (a logging logger; NeMo-RL's)
    vllm.v1.engine                          FinishReason (verl's abort path)
    vllm.v1.engine.async_llm                AsyncLLM
    vllm.v1.engine.exceptions               EngineDeadError, EngineGenerateError
    vllm.v1.metrics.reader                  Metric, Counter, Gauge, Vector, Histogram (what
                                            ``get_metrics()`` returns), get_metrics_snapshot
                                            (refused: no process-wide registry)
    vllm.v1.metrics.loggers                 PrometheusStatLogger (refused when built or passed)
    vllm.engine.arg_utils                   EngineArgs, AsyncEngineArgs (NeMo-RL's async worker)
    vllm.config                             CompilationConfig (a dict of its options, checked
                                            when the engine is built)
    vllm.utils                              random_uuid (OpenRLHF's request ids)
    vllm.utils.network_utils                get_open_port (a free port), get_ip (loopback)
    vllm.distributed.weight_transfer.*      the trainer's side of vLLM's NCCL weight transfer:
                                            base (the request types), nccl_common.trainer_init,
                                            packed_tensor.packed_nccl_broadcast_producer,
                                            nccl_engine.NCCLWeightTransferEngine (and its
                                            args); over dormant's group, not vLLM's
                                            (``vllm_weight_transfer.py``)

``vllm.__version__`` is ``VLLM_VERSION``: the newest vLLM release whose Python API dormant mirrors
(TRL 1.16 accepts 0.22 to 0.31), with dormant's version as its local part. A real vLLM that is
already imported is never shadowed: that raises ``VllmAlreadyImportedError``.
"""

from __future__ import annotations

import importlib.machinery
import logging
import socket
import sys
import types
import uuid
from typing import Any

from dormant.errors import EngineError

VLLM_VERSION = "0.31.0+dormant"
_MARKER = "__dormant_compat__"


class VllmAlreadyImportedError(EngineError, ImportError):
    """``install_as_vllm()`` after a real vLLM was imported: the two cannot share the name."""


def install_as_vllm() -> types.ModuleType:
    """Registers dormant as ``vllm`` (idempotent); returns the ``vllm`` module."""
    existing = sys.modules.get("vllm")
    if existing is not None:
        if getattr(existing, _MARKER, False):
            return existing
        raise VllmAlreadyImportedError(
            "a real vllm is already imported in this process; call dormant.install_as_vllm() "
            "before anything imports vllm, or use vLLM itself"
        )
    from dormant.core.errors import EngineDeadError, EngineGenerateError
    from dormant.core.sampling_params import RequestOutputKind, SamplingParams
    from dormant.engine import vllm_metrics
    from dormant.engine.async_llm import AsyncLLM
    from dormant.engine.llm import LLM
    from dormant.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from dormant.engine.vllm_internals import FinishReason

    inputs = {"TokensPrompt": TokensPrompt, "TextPrompt": TextPrompt}
    outputs = {"RequestOutput": RequestOutput, "CompletionOutput": CompletionOutput}
    root = _module(
        "vllm", LLM=LLM, AsyncLLMEngine=AsyncLLM, SamplingParams=SamplingParams,
        EngineArgs=EngineArgs, AsyncEngineArgs=AsyncEngineArgs, __version__=VLLM_VERSION,
        **outputs, **inputs,
    )  # fmt: skip
    _module("vllm.sampling_params", SamplingParams=SamplingParams,
            RequestOutputKind=RequestOutputKind, StructuredOutputsParams=StructuredOutputsParams,
            GuidedDecodingParams=StructuredOutputsParams)  # fmt: skip
    _module("vllm.outputs", **outputs)
    _module("vllm.logprobs", Logprob=Logprob)
    _module("vllm.inputs", **inputs)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.v1")
    _module("vllm.v1.engine", FinishReason=FinishReason)
    _module("vllm.v1.engine.async_llm", AsyncLLM=AsyncLLM)
    _module("vllm.v1.engine.exceptions", EngineDeadError=EngineDeadError,
            EngineGenerateError=EngineGenerateError)  # fmt: skip
    _module("vllm.v1.metrics")
    reader = ("Metric", "Counter", "Gauge", "Vector", "Histogram", "get_metrics_snapshot")
    _module("vllm.v1.metrics.reader", **{name: getattr(vllm_metrics, name) for name in reader})
    _module("vllm.v1.metrics.loggers", PrometheusStatLogger=PrometheusStatLogger)
    _module("vllm.engine")
    _module("vllm.engine.arg_utils", EngineArgs=EngineArgs, AsyncEngineArgs=AsyncEngineArgs)
    _module("vllm.config", CompilationConfig=CompilationConfig)
    _module("vllm.utils", random_uuid=random_uuid)
    _module("vllm.utils.network_utils", get_open_port=get_open_port, get_ip=get_ip)
    _module("vllm.distributed")
    _module("vllm.distributed.weight_transfer")
    _install_weight_transfer()
    return root


class EngineArgs:
    """vLLM's ``EngineArgs``: the engine's options as attributes (``model`` first), built into
    an engine by ``AsyncLLMEngine.from_engine_args(args)``, which validates them (an unknown
    option raises TypeError there, a value dormant cannot honour UnsupportedOptionError)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        if model is not None:
            self.model = model
        for name, value in options.items():
            setattr(self, name, value)


class AsyncEngineArgs(EngineArgs):
    """vLLM's ``AsyncEngineArgs`` (OpenRLHF: ``AsyncLLMEngine.from_engine_args(
    AsyncEngineArgs(**kwargs))``)."""


class CompilationConfig(dict[str, Any]):
    """vLLM's ``CompilationConfig(**options)`` (NeMo-RL's async worker builds one from
    ``vllm_kwargs.compilation_config``): a dict of the options, which the engine checks when it
    is built (``cudagraph_mode`` and ``cudagraph_capture_sizes``; any other raises there)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(options)


class PrometheusStatLogger:
    """vLLM's stat logger class, which callers pass in ``stat_loggers`` (NeMo-RL's async worker
    with ``enable_vllm_metrics_logger``): dormant takes none, so building one raises, and
    ``from_engine_args`` refuses it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from dormant.core.errors import UnsupportedOptionError

        raise UnsupportedOptionError(
            "PrometheusStatLogger: dormant takes no vLLM stat loggers; read the engine's "
            "get_metrics() or the server's /metrics (NeMo-RL: "
            "vllm_cfg.enable_vllm_metrics_logger=false)"
        )


def random_uuid() -> str:
    """vLLM's ``vllm.utils.random_uuid``: a fresh request id (32 hex digits)."""
    return uuid.uuid4().hex


class TokensPrompt(dict[str, Any]):
    """vLLM's ``TokensPrompt(prompt_token_ids=[...])``: a dict, as vLLM's TypedDict is."""


class TextPrompt(dict[str, Any]):
    """vLLM's ``TextPrompt(prompt="...")``."""


class StructuredOutputsParams:
    """vLLM's structured-output parameters: dormant has no guided decoding, so building one
    raises instead of letting a request run unconstrained."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from dormant.core.errors import UnsupportedSamplingParamsError

        raise UnsupportedSamplingParamsError(
            "structured outputs / guided decoding are not supported by dormant; remove them "
            "from the sampling params"
        )


def get_open_port() -> int:
    """A free TCP port on this host (vLLM's helper)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_ip() -> str:
    """The address a colocated engine is reached at: loopback (dormant serves one host)."""
    return "127.0.0.1"


def _install_weight_transfer() -> None:
    from dormant import vllm_weight_transfer as wt

    _module(
        "vllm.distributed.weight_transfer.base",
        WeightTransferInitRequest=wt.WeightTransferInitRequest,
        WeightTransferUpdateRequest=wt.WeightTransferUpdateRequest,
    )
    _module("vllm.distributed.weight_transfer.nccl_common", trainer_init=wt.trainer_init)
    _module(
        "vllm.distributed.weight_transfer.packed_tensor",
        packed_nccl_broadcast_producer=wt.packed_nccl_broadcast_producer,
        DEFAULT_PACKED_BUFFER_SIZE_BYTES=wt.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS=wt.DEFAULT_PACKED_NUM_BUFFERS,
    )
    _module(
        "vllm.distributed.weight_transfer.nccl_engine",
        NCCLWeightTransferEngine=wt.NCCLWeightTransferEngine,
        NCCLTrainerSendWeightsArgs=wt.NCCLTrainerSendWeightsArgs,
    )


def _module(name: str, **symbols: Any) -> types.ModuleType:
    module = types.ModuleType(name, f"dormant's stand-in for {name} (dormant.install_as_vllm)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []  # a package, so its submodules import
    setattr(module, _MARKER, True)
    for key, value in symbols.items():
        setattr(module, key, value)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module
