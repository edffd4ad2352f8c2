"""The engine configuration: frozen and validated, with vLLM's option names.

Values discovered at run time (the number of KV blocks, EOS ids) are not here: they live in
``EngineRuntime``, built once the model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from dormant.models import ModelConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
LoadFormat = Literal["auto", "dummy"]


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from.

    ``model`` is a Hugging Face directory (``config.json`` + safetensors), or a ``ModelConfig``
    for a random-initialised model (``load_format="dummy"``, seeded by ``seed``).
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
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    enable_sleep_mode: bool = True
    enforce_eager: bool = False  # False: decode runs from CUDA graphs on a GPU
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... max_num_seqs
    cuda_graph_multi_steps: int = 4  # steps of the fused multi-step graph; < 2 captures none
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = (
        None  # "mp" (default for TP > 1) or "external_launcher"
    )
    memory_poison: bool = False  # debug: fill discarded memory with 0xFF on wake
    memory_strict: bool = False  # refuse to discard undeclared allocations
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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
        if isinstance(model, ModelConfig):
            model_config, path = model, None
            options.setdefault("load_format", "dummy")
        else:
            path = str(model)
            model_config = ModelConfig.from_pretrained(path)
        model_config = replace(model_config, dtype=_resolve_dtype(dtype, model_config.dtype))
        max_model_len = max_model_len or min(model_config.max_position_embeddings, 2048)
        batched = max_num_batched_tokens or max(max_model_len, 4096)
        return cls(
            model=path,
            model_config=model_config,
            kv_cache_dtype=_resolve_kv_dtype(kv_cache_dtype),
            max_model_len=max_model_len,
            max_num_batched_tokens=batched,
            **options,
        )

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.model is None and self.load_format != "dummy":
            raise ValueError("a model given as a ModelConfig has no checkpoint: use 'dummy'")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("block_size", "max_model_len", "max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.distributed_executor_backend not in (None, "mp", "external_launcher"):
            raise ValueError(
                "distributed_executor_backend must be 'mp' or 'external_launcher', got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={self.model_config.max_position_embeddings}"
            )

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.model_config.dtype

    @property
    def max_num_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


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
