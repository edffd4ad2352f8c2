"""``llm.llm_engine.model_config``: the fields of vLLM's ``ModelConfig`` that RL frameworks read
(``max_model_len``, ``dtype``, ``hf_config``...), derived from the engine's ``EngineConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from dormant.core.config import EngineConfig


@dataclass(frozen=True)
class ModelConfigView:
    model: str | None
    tokenizer: str | None
    max_model_len: int
    dtype: torch.dtype
    seed: int
    max_logprobs: int
    logprobs_mode: str
    served_model_name: str | None
    skip_tokenizer_init: bool
    trust_remote_code: bool
    _config: EngineConfig

    @classmethod
    def of(cls, config: EngineConfig) -> ModelConfigView:
        served = config.served_model_name
        if isinstance(served, list | tuple):
            served = served[0] if served else None
        return cls(
            model=config.model,
            tokenizer=config.tokenizer or config.model,
            max_model_len=config.max_model_len,
            dtype=config.model_config.dtype,
            seed=config.seed,
            max_logprobs=config.max_logprobs,
            logprobs_mode=config.logprobs_mode,
            served_model_name=served or config.model,
            skip_tokenizer_init=config.skip_tokenizer_init,
            trust_remote_code=config.trust_remote_code,
            _config=config,
        )

    def get_vocab_size(self) -> int:
        return self._config.model_config.vocab_size

    @cached_property
    def hf_config(self) -> Any:
        """The model directory's ``transformers`` config; for a random model given as a
        ``ModelConfig``, that ``ModelConfig`` (it has the same field names)."""
        if self.model is None:
            return self._config.model_config
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(
            self.model, local_files_only=True, trust_remote_code=self.trust_remote_code
        )
