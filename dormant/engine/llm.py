"""``LLM``: the offline entry point, with vLLM's names and sleep-mode semantics.

llm = LLM(model="path/to/hf-dir", enable_sleep_mode=True)
outputs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
llm.sleep(level=2)                       # free nearly all GPU memory
...                                      # the trainer runs
llm.wake_up(["weights"])                 # map the weights back (contents discarded)
llm.update_weights(trainer_state_dict)   # refit in place; or collective_rpc("reload_weights")
llm.wake_up(["kv_cache"])                # and the KV cache; CUDA graphs stay valid
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dormant.core.config import EngineConfig
from dormant.core.sampling_params import SamplingParams
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import RequestOutput
from dormant.memory import AuditReport, MemoryStatus
from dormant.models import ModelConfig

Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """An engine you call directly. ``LLM`` *has* an engine; the engine has the scheduler and
    the workers. Options are vLLM's (see ``EngineConfig``); unknown options raise TypeError."""

    def __init__(self, model: str | Path | ModelConfig, **options: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.create(model, **options))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (text, token ids, or {"prompt_token_ids": [...]});
        returns the outputs in prompt order. Raises EngineAsleepError while asleep."""
        engine = self.llm_engine
        engine.check_can_generate()  # before queuing anything: a refused call leaves no trace
        batch = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        param_list = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(batch):
            raise ValueError(f"{len(param_list)} sampling params for {len(batch)} prompts")
        ids = [
            engine.add_request(_token_ids_or_text(p), sp)
            for p, sp in zip(batch, param_list, strict=True)
        ]
        done: dict[str, RequestOutput] = {}
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    done[output.request_id] = output
        except BaseException:
            engine.abort_request(ids)
            raise
        return [done[str(i)] for i in ids]

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Frees memory: level 1 offloads the weights to host RAM and discards the KV cache;
        level 2 discards both (refit before generating); level 0 only pauses scheduling."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Maps memory back at the same addresses: all tags, or the ones named."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def reload_weights(self, path: str | None = None) -> None:
        self.llm_engine.reload_weights(path)

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Refits in place from (HF name, tensor) pairs or a state dict; checks names, shapes
        and dtypes of all of them before writing any."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        self.llm_engine.update_weights(items)

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return self.llm_engine.collective_rpc(method, args, kwargs)

    # SGLang's names for the same operations.
    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's name: releases ``tags`` (all when None) with their level-1 policies: the KV
        cache is discarded, everything else is offloaded to host memory. Running requests are
        kept and resume (recomputing their KV) after ``resume_memory_occupation``."""
        self.llm_engine.release(tags)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self.wake_up(tags)

    def memory_status(self) -> list[MemoryStatus]:
        """Per rank: bytes and state per tag, the last sleep and wake timings, the residual."""
        return self.llm_engine.collective_rpc("memory_status")

    def audit(self) -> list[AuditReport]:
        return self.llm_engine.collective_rpc("audit")

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [items]  # one prompt given as token ids
    return items


def _token_ids_or_text(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return str(prompt["prompt"])
    return list(prompt)
