"""The engine configuration: frozen and validated, with vLLM's option names.

Values discovered at run time (the number of KV blocks, EOS ids) are not here: they live in
``EngineRuntime``, built once the model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from dormant.core import generation_config as sampling_source
from dormant.core.errors import UnsupportedOptionError
from dormant.core.sampling_params import SamplingParams
from dormant.core.speculative_config import SpeculativeConfig
from dormant.core.vllm_options import parse_weight_transfer_config, resolve_vllm_options
from dormant.models import ModelConfig

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16,
}  # fmt: skip
_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
LoadFormat = Literal["auto", "safetensors", "dummy"]
# vLLM's four values: what the logprobs (and the multi-step graph's) report: of the model's raw
# logits, or of the logits the sampler used (temperature, top-k/p, min-p, penalties applied).
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
# vLLM's names for how the workers are reached; "uni" is the in-process single rank.
ExecutorBackend = Literal["uni", "mp", "external_launcher", "ray"]
CommSleep = Literal["off", "suspend", "recreate"]
DEFAULT_MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from.

    ``model`` is a Hugging Face directory (``config.json`` + safetensors), or a ``ModelConfig``
    for a random-initialised model (``load_format="dummy"``, seeded by ``seed``).

    vLLM options with no dormant field (``quantization``, ``compilation_config``...) are
    resolved by ``create`` (see ``core/vllm_options.py``): a value dormant cannot honour raises
    ``UnsupportedOptionError``.
    """

    model: str | None
    model_config: ModelConfig
    load_format: LoadFormat = "auto"
    tokenizer: str | None = None
    seed: int = 0
    device: str = "auto"
    kv_cache_dtype: torch.dtype | None = None  # None: the model dtype
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_model_len: int = 2048
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 4096
    enable_sleep_mode: bool = True
    enforce_eager: bool = False  # False: decode runs from CUDA graphs on a GPU
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... max_num_seqs
    cuda_graph_multi_steps: int = 4  # steps of the fused multi-step graph; < 2 captures none
    tensor_parallel_size: int = 1
    # None: "uni" for one rank, "mp" for more ("ray" when a placement_group is given);
    # "external_launcher": this process is one rank; "ray": one Ray actor per rank
    distributed_executor_backend: ExecutorBackend | None = None
    # vLLM's: the Ray placement group whose bundles host the workers (None: the current one,
    # else one dormant creates). Not part of the configuration's identity.
    placement_group: Any = field(default=None, compare=False, repr=False)
    worker_extension_cls: str | None = None  # vLLM's: "pkg.module.Class" mixed into workers
    memory_poison: bool = False  # debug: fill discarded memory with 0xFF on wake
    memory_strict: bool = False  # refuse to discard undeclared allocations
    # Pin the host arena for a level-1 sleep in the background once the graphs are captured, so
    # the first sleep only copies (False: pin it at the first level-1 sleep, as vLLM does)
    prepare_sleep_arena: bool = True
    logprobs_mode: LogprobsMode = "raw_logprobs"
    max_logprobs: int = 20  # the most logprobs a request may ask for; -1: the vocabulary
    skip_tokenizer_init: bool = False  # prompts are token ids; outputs carry no text
    trust_remote_code: bool = False  # passed to the tokenizer and config loaders
    served_model_name: str | tuple[str, ...] | None = None
    # vLLM's defaults: cached KV blocks are found again by their tokens (never stale: the
    # engine drops them on any refit or KV discard), and steps mix decodes with prompt chunks
    # (None: on, as vLLM V1; False: a step is a prefill of whole prompts or a decode).
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool | None = None
    disable_log_stats: bool = True  # dormant logs no stats either way
    # vLLM's: a draft model or MTP layers propose tokens the target verifies (None: off);
    # built by ``create`` from vLLM's dict (``core/speculative_config.py``)
    speculative_config: SpeculativeConfig | None = None
    # The TP communicator's device memory while the whole engine sleeps (TP > 1): "suspend"
    # (ncclCommSuspend, NCCL >= 2.29.7), "recreate" (its process group destroyed and made
    # again at wake; eager only), or "off" (``distributed/comm_sleep.py``)
    comm_sleep: CommSleep = "off"
    # vLLM's: queue the next decode call before the host reads the one in flight, so the device
    # computes while the host applies tokens (``engine/successor.py``). None: on for one
    # in-process rank without speculative decoding (vLLM's None decides too); True also for TP
    # worker processes ("mp"); the tokens are those of synchronous steps either way.
    async_scheduling: bool | None = None
    # vLLM's: where requests that leave a sampling parameter unset take it from ("auto": the
    # model's generation_config.json; "vllm": nowhere; or a directory), and what overrides it
    # (``core/generation_config.py``; ``sampling_defaults`` below)
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict, compare=False)
    # vLLM's: turns on its weight-transfer API (``engine/weight_transfer.py``): None, or
    # {"backend": "nccl"} (NCCL on GPUs, gloo on the CPU)
    weight_transfer_config: dict[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def create(
        cls,
        model: str | Path | ModelConfig,
        *,
        dtype: str | torch.dtype = "auto",
        kv_cache_dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        **options: Any,
    ) -> EngineConfig:
        """Resolves user-facing options (strings, "auto") into a validated config.

        Unknown options raise TypeError: a misspelled option must never be silently ignored.
        """
        options = resolve_vllm_options(options)
        options["override_generation_config"] = sampling_source.parse_override(
            options.get("override_generation_config")
        )
        options["weight_transfer_config"] = parse_weight_transfer_config(
            options.get("weight_transfer_config")
        )
        if options.get("max_num_seqs", 0) is None:
            options["max_num_seqs"] = DEFAULT_MAX_NUM_SEQS
        if isinstance(options.get("served_model_name"), list):
            options["served_model_name"] = tuple(options["served_model_name"])
        if isinstance(model, ModelConfig):
            model_config, path = model, None
            options.setdefault("load_format", "dummy")
        else:
            path = str(model)
            model_config = ModelConfig.from_pretrained(path)
        model_config = replace(model_config, dtype=_resolve_dtype(dtype, model_config.dtype))
        max_model_len = max_model_len or min(model_config.max_position_embeddings, 2048)
        batched = max_num_batched_tokens or max(max_model_len, 4096)
        speculative = options.pop("speculative_config", None)
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            speculative = SpeculativeConfig.create(
                speculative,
                target_path=path,
                target_config=model_config,
                tensor_parallel_size=options.get("tensor_parallel_size", 1),
                max_model_len=max_model_len,
            )
        return cls(
            model=path,
            model_config=model_config,
            kv_cache_dtype=_resolve_kv_dtype(kv_cache_dtype),
            max_model_len=max_model_len,
            max_num_batched_tokens=batched,
            speculative_config=speculative,
            **options,
        )

    def __post_init__(self) -> None:
        _check_supported("load_format", self.load_format, get_args(LoadFormat))
        _check_supported("logprobs_mode", self.logprobs_mode, get_args(LogprobsMode))
        _check_supported(
            "distributed_executor_backend",
            self.distributed_executor_backend,
            (None, *get_args(ExecutorBackend)),
        )
        _check_ray_options(self.distributed_executor_backend, self.placement_group)
        _check_supported("comm_sleep", self.comm_sleep, get_args(CommSleep))
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1:
            raise UnsupportedOptionError(
                "distributed_executor_backend='uni' runs one rank in this process, but "
                f"tensor_parallel_size={self.tensor_parallel_size}; use 'mp' or "
                "'external_launcher'"
            )
        if self.async_scheduling and not self.overlaps_steps:
            raise UnsupportedOptionError(
                "async_scheduling=True overlaps the steps of the in-process executors ('uni', "
                "'mp') without speculative decoding; this engine has "
                f"distributed_executor_backend={self.distributed_executor_backend!r}, "
                f"speculative_config={'set' if self.speculative_config else None}: leave "
                "async_scheduling unset (on where it applies) or set it False"
            )
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be an int >= 0, or -1 for the vocabulary size; got "
                f"{self.max_logprobs!r}"
            )
        if self.model is None and self.load_format != "dummy":
            raise ValueError("a model given as a ModelConfig has no checkpoint: use 'dummy'")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("block_size", "max_model_len", "max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={self.model_config.max_position_embeddings}"
            )

        sampling_source.check_source(self.generation_config)
        defaults = self.sampling_defaults
        try:
            SamplingParams(**defaults)  # a bad default raises now, not on every request
        except ValueError as error:
            raise UnsupportedOptionError(
                f"the default sampling parameters {defaults} (generation_config="
                f"{self.generation_config!r}, then override_generation_config) are invalid: "
                f"{error}; fix them, or pass generation_config='vllm'"
            ) from error

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """vLLM's ``get_diff_sampling_param``: the ``SamplingParams`` fields a request that
        leaves them unset takes (from ``generation_config``, then its override; read anew on
        each call, so callers keep the result)."""
        return sampling_source.sampling_defaults(
            self.generation_config, self.model, self.override_generation_config
        )

    @property
    def overlaps_steps(self) -> bool:
        """Whether async scheduling applies, without speculative decoding: unless turned off,
        for one rank in this process (``UniprocExecutor``, run on the H200); when asked for
        (``async_scheduling=True``), also for a worker process per rank (``MultiprocExecutor``,
        tested over gloo on CPUs, not yet on GPUs: not a default until it is)."""
        if self.async_scheduling is False or self.speculative_config is not None:
            return False
        if self.placement_group is not None:
            return False
        backend, one_rank = self.distributed_executor_backend, self.tensor_parallel_size == 1
        if backend in (None, "uni") and one_rank:
            return True
        return bool(self.async_scheduling) and backend in (None, "mp") and not one_rank

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.model_config.dtype

    @property
    def max_num_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def _check_supported(name: str, value: object, supported: tuple[object, ...]) -> None:
    if value not in supported:
        raise UnsupportedOptionError(
            f"{name}={value!r} is not supported by dormant; supported: "
            f"{', '.join(repr(v) for v in supported)}"
        )


def _check_ray_options(backend: str | None, placement_group: Any) -> None:
    """Ray is optional: choosing it without Ray installed names the extra to install."""
    if placement_group is not None and backend not in (None, "ray"):
        raise UnsupportedOptionError(
            f"placement_group is a Ray placement group, but distributed_executor_backend="
            f"{backend!r}; use distributed_executor_backend='ray' (or leave it unset)"
        )
    if (backend == "ray" or placement_group is not None) and find_spec("ray") is None:
        raise UnsupportedOptionError(
            "distributed_executor_backend='ray' needs Ray, which is not installed: "
            "pip install 'dormant[ray]'"
        )


def _resolve_dtype(dtype: str | torch.dtype, default: torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return default
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _resolve_kv_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be 'auto' or one of {sorted(_KV_DTYPES)}, got {dtype!r}"
        )
    return _KV_DTYPES[dtype]
