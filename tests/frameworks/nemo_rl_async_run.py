"""NeMo-RL's engine calls with ``vllm_cfg.async_engine: true`` (its async GRPO and non-colocated
recipes), over dormant installed as vllm, in their order. ``vwa`` is
``nemo_rl/models/generation/vllm/vllm_worker_async.py`` at NVIDIA-NeMo/RL@7ea279ab; ``vw``,
``vg`` and ``grpo`` are as in ``test_nemo_rl_calls.py``, whose test runs this in its own
interpreter and checks the JSON line it prints:

    step                        NeMo-RL's call                                       where
    ──────────────────────────  ───────────────────────────────────────────────────  ──────────
    start the engine            from vllm.config import CompilationConfig;          vwa L165-
                                vllm.engine.arg_utils import AsyncEngineArgs;       200
                                vllm.v1.engine.async_llm import AsyncLLM;
                                vllm.v1.metrics.loggers import PrometheusStatLogger;
                                CompilationConfig(**vllm_kwargs' dict);
                                AsyncLLM.from_engine_args(AsyncEngineArgs(**kw),
                                stat_loggers=[])
    post_init_async             await collective_rpc("report_device_id", args=())    vwa L327-
                                                                                     333, 1386-
                                                                                     1401
    weight-update group         await collective_rpc("init_collective", ...),        vwa L980-
                                ("prepare_refit_info", (state_dict_info,))           997, 1406-
                                                                                     1408
    finish_generation           reset_prefix_cache(); reset_mm_cache() where it      vwa L1571-
                                exists; sleep(level=1)                               1593
    prepare_for_generation      wake_up(tags=[...])                                  vwa L1595-
                                                                                     1612
    refit                       await collective_rpc("update_weights_from_           vwa L1459-
                                collective", args=()); reset_encoder_cache()         1494, 1410-
                                (reset_encoder_cache_after_weight_update)            1417
    step metrics                llm.get_metrics() where it exists, else vLLM's       vw L762-786
                                get_metrics_snapshot()
    generate_async              per sample: generate(prompt={"prompt_token_ids":    vwa L1039-
                                ids}, sampling_params=..., request_id=uuid4);       1199
                                outputs[0].token_ids, .logprobs[i][token].logprob,
                                .finish_reason; routed experts by getattr           utils L141-
                                                                                     154
    shutdown                    await collective_rpc("cleanup"); llm.shutdown()      vwa L1614-
                                                                                     1631

    python tests/frameworks/nemo_rl_async_run.py WORKDIR
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import dormant

dormant.install_as_vllm()  # before NeMo-RL's `import vllm`

import vllm  # noqa: E402

from dormant.core.errors import UnsupportedOptionError  # noqa: E402
from tests.engine.conftest import PROMPTS, write_checkpoint  # noqa: E402
from tests.frameworks.nemo_rl_run import (  # noqa: E402
    Trainer,
    fresh,
    llm_kwargs,
    raw_spec_counters,
    sampling_params,
)


def create_engine(kwargs: dict[str, Any]) -> Any:
    """vwa L165-200 (the CompilationConfig conversion with ``vllm_kwargs.compilation_config``
    set; no ``enable_vllm_metrics_logger``, so no stat loggers)."""
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    if kwargs.get("compilation_config"):
        compilation_config = dict(kwargs["compilation_config"])
        kwargs["compilation_config"] = CompilationConfig(**compilation_config)
    engine_args = AsyncEngineArgs(**kwargs)
    assert PrometheusStatLogger is not None  # only passed with the metrics logger on
    return AsyncLLM.from_engine_args(engine_args, stat_loggers=[])


async def sleep_async(llm: Any) -> None:
    """vwa L1571-1593 (finish_generation)."""
    await llm.reset_prefix_cache()
    if hasattr(llm, "reset_mm_cache"):
        await llm.reset_mm_cache()
    await llm.sleep(level=1)


async def refit(llm: Any, trainer: Trainer) -> list[bool]:
    """vwa L1459-1494 then L1410-1417, while the trainer broadcasts (grpo L2396-2403)."""
    trainer.conn.send("broadcast")
    results = await llm.collective_rpc("update_weights_from_collective", args=tuple())
    trainer.conn.recv()
    if all(results):
        await llm.reset_encoder_cache()  # reset_encoder_cache_after_weight_update: true
    return list(results)


async def generate_async(llm: Any, greedy: bool) -> list[dict[str, Any]]:
    """vwa L1039-1230: one task per sample, each reading its final output."""

    async def one(ids: list[int]) -> dict[str, Any]:
        request_id = str(uuid.uuid4())
        generator = llm.generate(
            prompt={"prompt_token_ids": ids},
            sampling_params=sampling_params(greedy),
            request_id=request_id,
        )
        final_request_output = None
        async for req_output in generator:
            final_request_output = req_output
        if final_request_output is None:
            raise RuntimeError(f"No output received for request {request_id}")
        details = final_request_output.outputs[0]
        tokens = list(details.token_ids)
        logprobs = [0.0] * len(tokens)
        if hasattr(details, "logprobs") and details.logprobs:
            for idx, logprob_dict in enumerate(details.logprobs):
                if logprob_dict and idx < len(tokens) and tokens[idx] in logprob_dict:
                    logprobs[idx] = logprob_dict[tokens[idx]].logprob
        routed = getattr(details, "routed_experts", None)
        prompt_routed = getattr(final_request_output, "prompt_routed_experts", None)
        return {
            "tokens": tokens,
            "logprobs": logprobs,
            "truncated": details.finish_reason == "length",
            "routed_experts": [routed, prompt_routed],
        }

    return list(await asyncio.gather(*(one(list(ids)) for ids in PROMPTS)))


async def main(workdir: Path) -> dict[str, Any]:
    base = write_checkpoint(workdir / "ckpt1", 1, with_tokenizer=False)
    report: dict[str, Any] = {"fresh": [fresh(workdir, seed) for seed in (2, 3)], "steps": []}
    kwargs = llm_kwargs(base, "dummy")
    kwargs["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    llm = create_engine(kwargs)
    report["vllm_is_dormant"] = isinstance(llm, dormant.AsyncLLM)
    report["device_ids"] = await llm.collective_rpc("report_device_id", args=tuple())
    await sleep_async(llm)  # grpo L1190
    trainer = Trainer([2, 3])
    try:
        await llm.collective_rpc("init_collective", args=(0, "127.0.0.1", trainer.port, 2, 1))
        await llm.collective_rpc("prepare_refit_info", args=(trainer.state_dict_info,))
        for _ in range(2):
            await llm.wake_up(tags=["weights"])
            step: dict[str, Any] = {"update_results": await refit(llm, trainer)}
            await llm.wake_up(tags=["kv_cache"])
            step["metrics_before"] = raw_spec_counters(llm)
            greedy = await generate_async(llm, greedy=True)
            step["greedy_tokens"] = [sample["tokens"] for sample in greedy]
            step["greedy_logprobs"] = [sample["logprobs"] for sample in greedy]
            step["truncated"] = [sample["truncated"] for sample in greedy]
            step["routed_experts"] = [sample["routed_experts"] for sample in greedy]
            sampled = await generate_async(llm, greedy=False)
            step["sampled_logprobs"] = [sample["logprobs"] for sample in sampled]
            step["metrics_after"] = raw_spec_counters(llm)
            step["is_sleeping"] = await llm.is_sleeping()
            await sleep_async(llm)
            report["steps"].append(step)
        report["asleep_after_finish"] = list(await llm.asleep_tags())
        report["stat_logger_refusal"] = stat_logger_refusal(kwargs)
        await llm.collective_rpc("cleanup", args=tuple())
        trainer.conn.send("done")
        trainer.process.join(timeout=60)
    finally:
        llm.shutdown()
    return report


def stat_logger_refusal(kwargs: dict[str, Any]) -> str:
    """vwa L193-200 with ``enable_vllm_metrics_logger``: the engine is refused before it
    starts, with what to set instead."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    try:
        AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[PrometheusStatLogger])
    except UnsupportedOptionError as error:
        return str(error)
    return "accepted"


if __name__ == "__main__":
    assert vllm.AsyncLLMEngine is dormant.AsyncLLM
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))))
