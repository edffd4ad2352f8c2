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

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from dormant.core.config import EngineConfig
from dormant.core.sampling_params import SamplingParams
from dormant.engine.engine_status import EngineMemoryStatus
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.llm_sglang import SGLangCalls
from dormant.engine.outputs import RequestOutput
from dormant.engine.request_stream import check_vllm_request_options
from dormant.engine.tokenizer import TokenizerError
from dormant.engine.vllm_metrics import Metric, engine_metrics
from dormant.engine.weight_transfer import WeightTransfer, is_update_request
from dormant.memory import AuditReport
from dormant.models import ModelConfig
from dormant.vllm_weight_transfer import WeightTransferInitRequest, WeightTransferUpdateRequest

Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM(SGLangCalls):
    """An engine you call directly. ``LLM`` *has* an engine; the engine has the scheduler and
    the workers. Options are vLLM's (see ``EngineConfig``); unknown options raise TypeError."""

    def __init__(self, model: str | Path | ModelConfig, **options: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.create(model, **options))
        self._sampling_defaults = self.llm_engine.config.sampling_defaults
        config = self.llm_engine.config
        self.weight_transfer = WeightTransfer(
            self.llm_engine.refits, config.weight_transfer_config, config.device
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what ``generate`` samples with when given no ``sampling_params``: the
        model's ``generation_config.json`` (and ``override_generation_config``) over vLLM's
        neutral defaults; a new object each call."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (text, token ids, or vLLM's ``{"prompt_token_ids":
        [...]}``); returns one ``RequestOutput`` per prompt, in prompt order, each with
        ``params.n`` completions. ``use_tqdm`` shows a progress bar over the prompts (or is a
        ``tqdm``-like callable to make it with). Without ``sampling_params`` it samples with
        ``get_default_sampling_params()``. ``lora_request`` (one, or one per prompt) and
        ``priority`` (one per prompt) are vLLM's: only None and 0 are accepted.

        Every prompt and its parameters are validated before any is queued: a bad one raises
        (``InvalidSamplingParamsError``, ``RequestTooLongError``...) and queues nothing.
        Raises EngineAsleepError while asleep.
        """
        loras = lora_request if isinstance(lora_request, list | tuple) else [lora_request]
        for lora in loras:
            check_vllm_request_options(lora, 0)
        for rank in priority or ():
            check_vllm_request_options(None, rank)
        engine = self.llm_engine
        engine.check_can_generate()  # before queuing anything: a refused call leaves no trace
        batch = _as_prompt_list(prompts)
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        param_list = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(batch):
            raise ValueError(f"{len(param_list)} sampling params for {len(batch)} prompts")
        requests = [
            engine.make_request_input(p, sp) for p, sp in zip(batch, param_list, strict=True)
        ]
        ids: list[int] = []
        done: dict[str, RequestOutput] = {}
        progress = _progress_bar(use_tqdm, len(requests))
        try:
            for request in requests:
                ids.append(engine.add_request_input(request))
            while engine.has_unfinished_requests():
                for output in engine.step():
                    done[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [done[str(i)] for i in ids]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: renders each conversation (one, or a list of them) with the
        tokenizer's chat template, tokenizes it without adding special tokens (the template
        has them), and ``generate``s from those ids. Raises ``TokenizerError`` without a
        tokenizer or a chat template; renders every conversation before queuing any."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise TokenizerError(
                "LLM.chat needs the tokenizer's chat template: this engine has no tokenizer or "
                "it has no chat template; pass chat_template=..., or render the prompt "
                "yourself and call generate"
            )
        is_one = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if is_one else messages
        options = dict(
            chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
        )  # fmt: skip
        options.update(chat_template_kwargs or {})
        texts = [
            tokenizer.apply_chat_template(list(c), tokenize=False, **options) for c in conversations
        ]
        prompts = [
            {"prompt_token_ids": tokenizer.encode(t, add_special_tokens=False)} for t in texts
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def get_tokenizer(self) -> Any:
        """The tokenizer (the ``transformers`` one for a HF model), as vLLM's; None under
        ``skip_tokenizer_init``."""
        tokenizer = self.llm_engine.tokenizer
        return getattr(tokenizer, "hf_tokenizer", tokenizer)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's: drops every cached KV block; returns True. Frameworks call it after every
        refit and wake, but dormant never needs it: the engine itself drops cached KV whenever
        a weight is written or KV memory is discarded (DESIGN §3 invariant 10). Blocks held by
        running requests stay held (``reset_running_requests`` and ``reset_connector``, which
        has no KV connector to reset here, are accepted for vLLM's callers) and are not cached
        again."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def sleep(self, level: int = 1, mode: str = "abort", release_context: bool = False) -> None:
        """Frees memory: level 1 offloads the weights to host RAM and discards the KV cache;
        level 2 discards both (refit before generating); level 0 only pauses scheduling.
        ``release_context=True`` (one GPU, no NCCL group, display driver 570+) then has the
        driver checkpoint the rest, the CUDA context included: the GPU shows nothing for this
        process until ``wake_up``, which restores it first (dormant.memory.process_checkpoint).
        """
        self.llm_engine.sleep(level, mode, release_context)

    def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Maps memory back at the same addresses: all tags, or the ones named (with their
        groups: ``["weights"]`` also wakes ``runtime``). Returns whether the engine is now
        fully awake, as recent vLLM does."""
        return self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def reload_weights(self, path: str | None = None, weight_version: str | None = None) -> None:
        self.llm_engine.reload_weights(path, weight_version)

    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]]
        | Mapping[str, Any]
        | WeightTransferUpdateRequest,
        weight_version: str | None = None,
    ) -> None:
        """Refits in place from (HF name, tensor) pairs or a state dict, host or device, floats
        of any dtype (cast on copy); checks names and shapes of all of them before writing.

        Given vLLM's ``WeightTransferUpdateRequest`` (or ``{"update_info": {...}}``), receives
        the trainer's broadcast instead, as vLLM's weight-transfer engine does (between
        ``start_weight_update`` and ``finish_weight_update``)."""
        if is_update_request(weights):
            self.weight_transfer.update(cast(WeightTransferUpdateRequest, weights))
            return
        items = weights.items() if isinstance(weights, Mapping) else weights
        self.llm_engine.update_weights(
            cast(Iterable[tuple[str, torch.Tensor]], items), weight_version
        )

    def init_weight_transfer_engine(
        self, request: WeightTransferInitRequest | Mapping[str, Any]
    ) -> None:
        """vLLM's: every rank joins the trainer's weight-transfer group (``init_info``:
        ``master_address``, ``master_port``, ``rank_offset``, ``world_size``, optionally
        ``packed``); needs ``weight_transfer_config={"backend": "nccl"}``."""
        self.weight_transfer.init(request)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """vLLM's: opens a weight-update session (``update_weights(request)`` calls, then
        ``finish_weight_update``)."""
        self.weight_transfer.start(is_checkpoint_format)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """vLLM's: closes the session; ``weight_version`` names the weights it wrote."""
        self.weight_transfer.finish(weight_version)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's ``LLM.collective_rpc``: ``method`` (a built-in, a worker extension's method,
        or a callable ``fn(worker, *args, **kwargs)``) on every rank; one result per rank."""
        return self.llm_engine.collective_rpc(method, args, kwargs, timeout)

    def memory_status(self) -> list[EngineMemoryStatus]:
        """Per rank: bytes and state per tag, the last sleep and wake timings, the residual,
        and the engine's prefix cache (``prefix_cache``: hit rate, cached blocks)."""
        return self.llm_engine.memory_status()

    def audit(self) -> list[AuditReport]:
        return self.llm_engine.collective_rpc("audit")

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's ``vllm:*`` metric records (``engine/vllm_metrics.py``)."""
        return engine_metrics(self.llm_engine)

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
        return [cast(list[int], items)]  # one prompt given as token ids
    return cast(list[Prompt], items)


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    if use_tqdm is False:
        return None
    if use_tqdm is True:
        from tqdm import tqdm  # type: ignore[import-untyped]

        return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
    return use_tqdm(total=total, desc="Processed prompts")
