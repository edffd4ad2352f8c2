"""Stand-ins for the Ray actors in which OpenRLHF and NeMo-RL build their engines with
``distributed_executor_backend="ray"``, making the same calls on dormant that they make on vLLM
(our code; each call is cited by file and line of the snapshot read). Importable by the Ray
workers (no pytest here); ``test_ray_frameworks.py`` drives them.

- OpenRLHF ``openrlhf/trainer/ray/vllm_engine.py`` at OpenRLHF/OpenRLHF@3c3be62
- NeMo-RL ``nemo_rl/models/generation/vllm/vllm_worker.py`` at NVIDIA-NeMo/RL@7ea279a

Where they name their own worker extension (``openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap``,
``nemo_rl...VllmInternalWorkerExtension``), the tests pass ``RefitExtension`` from
``tests/engine/worker_extensions.py``: neither framework is installed here.
"""

from __future__ import annotations

import os
from copy import deepcopy
from types import SimpleNamespace
from typing import Any

from dormant import LLM, AsyncLLM, SamplingParams


def placement_of(llm: LLM) -> dict[str, Any]:
    """Where the engine's workers run (for the tests' asserts)."""
    executor = llm.llm_engine.executor
    placement = executor.placement
    return {
        "executor": type(executor).__name__,
        "group": placement.placement_group.id.hex(),
        "bundles": list(placement.bundle_indices),
        "is_owned": placement.is_owned,
        "pids": executor.pids,
    }


class OpenRLHFRolloutActor:
    """``RolloutRayActor`` (vllm_engine.py L33-65): an async actor that builds
    ``AsyncLLMEngine.from_engine_args(AsyncEngineArgs(*args, **kwargs))`` (L63-64)."""

    async def __init__(self, *args: Any, bundle_indices: list | None = None, **kwargs: Any):
        self._configure_device_env(
            backend=kwargs.get("distributed_executor_backend"),
            bundle_indices=bundle_indices,
            num_gpus=kwargs.pop("num_gpus"),
        )
        kwargs.pop("full_determinism", False)  # L51: read by _configure_vllm_env only
        engine_args = SimpleNamespace(*args, **kwargs)  # vllm.AsyncEngineArgs: attributes
        self.llm = AsyncLLM.from_engine_args(engine_args)
        await self.llm.is_sleeping()  # L65

    def _configure_device_env(self, backend: Any, bundle_indices: Any, num_gpus: Any) -> None:
        """L71-88: Ray must not narrow the visible devices; the workers' bundles and GPU share
        reach vLLM (here dormant) through VLLM_RAY_BUNDLE_INDICES / VLLM_RAY_PER_WORKER_GPUS."""
        if backend == "ray":
            for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
                os.environ.pop(name, None)
        if bundle_indices is not None:
            os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(num_gpus)
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundle_indices))

    async def sleep(self, level: int = 1) -> None:  # L138-139
        await self.llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:  # L141-153: tag by tag
        if tags is None:
            tags = ["weights", "kv_cache"]
        for tag in tags:
            await self.llm.wake_up(tags=[tag])

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any) -> Any:
        """L155-179 (``TokensPrompt`` is a dict of ``prompt_token_ids``; ``random_uuid`` ids)."""
        import uuid

        generator = self.llm.generate(
            {"prompt_token_ids": prompt_token_ids},
            deepcopy(sampling_params),
            request_id=uuid.uuid4().hex,
        )
        final_output = None
        async for request_output in generator:
            final_output = request_output
        return list(final_output.outputs[0].token_ids)

    async def collective_rpc(self, method: str) -> list[Any]:
        return await self.llm.collective_rpc(method)

    def placement(self) -> dict[str, Any]:
        return placement_of(self.llm.llm)

    def shutdown(self) -> None:
        self.llm.shutdown()


class NemoRLGenerationWorker:
    """``VllmGenerationWorker`` (vllm_worker.py): the model owner of a TP group builds
    ``vllm.LLM(**llm_kwargs)`` (L814-817) from ``_load_model``'s kwargs (L570-601)."""

    def __init__(
        self, model: str, bundle_indices: list[int], fraction_of_gpus: float, seed: int, **cfg
    ) -> None:
        tp = cfg["tensor_parallel_size"]
        # L402-415: vLLM manages the GPUs of a parallel group; bundles and share by env
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        os.environ["VLLM_RAY_PER_WORKER_GPUS"] = str(fraction_of_gpus / tp)
        os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundle_indices))
        llm_kwargs = dict(
            model=model,
            served_model_name=model,
            load_format="auto",
            skip_tokenizer_init=False,
            tensor_parallel_size=tp,
            pipeline_parallel_size=1,
            enable_expert_parallel=False,
            gpu_memory_utilization=cfg["gpu_memory_utilization"],
            enable_prefix_caching=True,
            dtype=cfg["precision"],
            seed=seed,
            enforce_eager=False,
            max_model_len=cfg["max_model_len"],
            trust_remote_code=True,
            worker_extension_cls=cfg["worker_extension_cls"],
            enable_sleep_mode=True,
            disable_log_stats=False,
            distributed_executor_backend="ray",  # L417-422 (worker_utils.py L16-26): TP > 1
            hf_overrides={},  # L491-492: always a dict
            logprobs_mode=cfg["logprobs_mode"],  # L599-601
        )
        self.llm = LLM(**llm_kwargs)

    def generate(self, prompt_token_ids: list[list[int]], max_new_tokens: int) -> list[Any]:
        """``_build_sampling_params`` (L641-668, greedy) and ``self.llm.generate(prompts,
        sampling_params, use_tqdm=...)`` (L932)."""
        sampling_params = SamplingParams(
            temperature=0.0, top_p=1.0, top_k=1, max_tokens=max_new_tokens, logprobs=0,
            stop_token_ids=None, stop=None, include_stop_str_in_output=True, bad_words=None,
            ignore_eos=False,
        )  # fmt: skip
        prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, sampling_params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def sleep(self) -> None:
        """L1286-1309: the prefix cache reset, then ``sleep(level=1)``."""
        self.llm.reset_prefix_cache()
        self.llm.sleep(level=1)

    def wake_up(self, **kwargs: Any) -> None:  # L1314-1330
        tags = kwargs.get("tags")
        wake_up_args = {}
        if tags is not None:
            wake_up_args["tags"] = tags
        self.llm.wake_up(**wake_up_args)

    def collective_rpc(self, method: str) -> list[Any]:
        return self.llm.collective_rpc(method, args=tuple())

    def placement(self) -> dict[str, Any]:
        return placement_of(self.llm)

    def shutdown(self) -> None:
        self.llm.shutdown()
