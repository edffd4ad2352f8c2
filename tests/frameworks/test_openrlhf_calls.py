"""OpenRLHF's calls to its vLLM rollout engine (issue #15, section 3), made against dormant's
``AsyncLLM`` in OpenRLHF's order, with its arguments, reading the fields it reads. Our own code;
only the calls are OpenRLHF's, read at OpenRLHF/OpenRLHF@3c3be62 (``vllm_engine.py`` is
``openrlhf/trainer/ray/vllm_engine.py``, ``ppo_actor.py`` is ``openrlhf/trainer/ray/
ppo_actor.py``, ``generator.py`` is ``openrlhf/trainer/ppo_utils/samples_generator.py``,
``agent.py`` is ``openrlhf/utils/agent.py``). The engine's side of the weight sync is
``tests/frameworks/openrlhf_worker_wrap.py``, shaped like OpenRLHF's ``WorkerWrap``.

A colocated PPO step with ``--vllm.enable_sleep`` (train_ppo_ray.py L66-82):

    call                                                   OpenRLHF's source
    ─────────────────────────────────────────────────────  ───────────────────────────────────
    AsyncLLMEngine.from_engine_args(AsyncEngineArgs(       vllm_engine.py L63-65 with the
        **kwargs)), then await is_sleeping()               kwargs of L266-282, L295-297
    sleep(level=1)                                         vllm_engine.py L138-139, L310-311
    collective_rpc("init_process_group", args=(address,    ppo_actor.py L110-153 (world size
        port, rank_offset, world_size, "openrlhf",         engines*TP + 1, the trainer rank 0);
        backend, use_ray))                                 vllm_engine.py L109-115
    wake_up() = wake_up(tags=["weights"]), then            generator.py L106-107;
        wake_up(tags=["kv_cache"])                         vllm_engine.py L141-153
    output_processor.get_num_unfinished_requests()         generator.py L216; vllm_engine.py
                                                           L181-183
    generate(TokensPrompt(prompt_token_ids=...),           agent.py L202-263 (SamplingParams of
        deepcopy(params), request_id=random_uuid());       generator.py L203-211); vllm_engine.py
        read outputs[0].token_ids, .finish_reason,         L155-179
        .logprobs[i].get(token).logprob; list + token_ids
    sleep(level=1)                                         generator.py L119-120
    wake_up(tags=["weights"])                              ppo_trainer.py L311-314
    reset_prefix_cache() (with prefix caching)             ppo_actor.py L409-414; vllm_engine.py
                                                           L129-130
    per parameter: collective_rpc("update_weight", args=(  ppo_actor.py L420-436 (rank 0
        name, dtype, shape, empty_cache)) while rank 0     broadcasts each one); vllm_engine.py
        broadcasts it                                      L117-121
      or collective_rpc("update_weight_cuda_ipc", args=(   ppo_actor.py L438-465 (colocated with
        name, dtype, shape, {gpu uuid: handle},            NCCL: CUDA IPC); vllm_engine.py
        empty_cache))                                      L123-127
    pause_generation(mode="keep") ... resume_generation()  ppo_trainer_async.py L255-265
                                                           (partial rollout); vllm_engine.py
                                                           L132-136

Each sequence checks that the tokens after the refit equal a fresh engine's on the new weights,
that nothing is left asleep, and that calls in the wrong order raise typed errors and change
nothing.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from copy import deepcopy
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dormant import SamplingParams
from dormant.engine import EngineAsleepError
from dormant.engine.async_llm import AsyncLLM as AsyncLLMEngine
from dormant.executors.multiproc import free_port
from dormant.vllm_compat import AsyncEngineArgs, TokensPrompt, random_uuid
from tests.engine.conftest import write_checkpoint

REPO = Path(__file__).resolve().parents[2]
EXTENSION = "tests.frameworks.openrlhf_worker_wrap.WorkerWrap"
GROUP = "openrlhf"  # ppo_actor.py L130
PROMPTS = [[5, 17, 99, 3, 250, 42], [101, 202, 33, 44, 55, 66, 77, 88, 99, 11]]
MAX_LEN = 24  # generate_kwargs["max_len"]: prompt and response share it (agent.py L217-219)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("openrlhf")
    return {seed: write_checkpoint(root / f"seed{seed}", seed=seed) for seed in (1, 2)}


def engine_kwargs(model: Path, device: str, seed: int = 42) -> dict[str, Any]:
    """vllm_engine.py L266-282 and L295-297 for engine 0 of TP 1 (``"uni"``), with what
    ``RolloutRayActor.__init__`` pops (bundle_indices, num_gpus, full_determinism) gone and
    the correction on (``logprobs_mode``); ``device`` and the KV size are dormant's (the
    host backend has no GPU memory to size from)."""
    return {
        "model": str(model),
        "enforce_eager": False,
        "worker_extension_cls": EXTENSION,
        "tensor_parallel_size": 1,
        "seed": seed + 0,
        "distributed_executor_backend": "uni",
        "max_model_len": 256,
        "enable_prefix_caching": True,
        "dtype": "bfloat16",
        "trust_remote_code": True,
        "gpu_memory_utilization": 0.5,
        "enable_sleep_mode": True,
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": 1,
        "device": device,
        "kv_cache_memory_bytes": 4 << 20,
    }


async def start_engine(model: Path, device: str) -> AsyncLLMEngine:
    """vllm_engine.py L63-65."""
    engine_args = AsyncEngineArgs(**engine_kwargs(model, device))
    llm = AsyncLLMEngine.from_engine_args(engine_args)
    assert await llm.is_sleeping() is False
    return llm


def sampling_params(**generate_kwargs: Any) -> SamplingParams:
    """generator.py L203-211, with the correction on (``logprobs=1``)."""
    return SamplingParams(
        temperature=generate_kwargs.get("temperature", 1.0),
        top_p=generate_kwargs.get("top_p", 1.0),
        top_k=generate_kwargs.get("top_k", -1),
        max_tokens=generate_kwargs.get("max_new_tokens"),  # None = dynamic per-prompt
        min_tokens=generate_kwargs.get("min_new_tokens", 1),
        skip_special_tokens=generate_kwargs.get("skip_special_tokens", False),
        logprobs=1,
    )


async def generate(llm: AsyncLLMEngine, prompt_token_ids: list[int], params: SamplingParams):
    """RolloutRayActor.generate (vllm_engine.py L155-179): the last of the stream."""
    prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
    generator = llm.generate(prompt, deepcopy(params), request_id=random_uuid())
    final_output = None
    async for request_output in generator:
        final_output = request_output
    return final_output


async def execute(llm: AsyncLLMEngine, prompt_token_ids: list[int], params: SamplingParams):
    """SingleTurnAgentExecutor.execute (agent.py L202-263) on token ids: the observation
    (``prompt + action``, a list), the rollout logprobs and whether it was truncated."""
    effective_params = params
    if params.max_tokens is None:
        effective_params = deepcopy(params)
        effective_params.max_tokens = max(1, MAX_LEN - len(prompt_token_ids))
    request_output = await generate(llm, prompt_token_ids, deepcopy(effective_params))
    generation_output = request_output.outputs[0]
    action_token_ids = generation_output.token_ids
    is_truncated = generation_output.finish_reason == "length"
    observation_token_ids = prompt_token_ids + action_token_ids
    rollout_log_probs = None
    if params.logprobs is not None and generation_output.logprobs is not None:
        rollout_log_probs = [0.0] * len(prompt_token_ids)
        for token_id, logprob_dict in zip(action_token_ids, generation_output.logprobs):  # noqa: B905
            token_logprob = logprob_dict.get(token_id)
            rollout_log_probs.append(token_logprob.logprob if token_logprob is not None else 0.0)
    return observation_token_ids, rollout_log_probs, is_truncated


async def wake_up(llm: AsyncLLMEngine, tags: list[str] | None = None) -> None:
    """vllm_engine.py L141-153: one tag at a time."""
    if tags is None:
        tags = ["weights", "kv_cache"]
    for tag in tags:
        await llm.wake_up(tags=[tag])


async def rollout(llm: AsyncLLMEngine, **generate_kwargs: Any) -> list[Any]:
    params = sampling_params(**generate_kwargs)
    assert llm.output_processor.get_num_unfinished_requests() == 0  # generator.py L216
    return [await execute(llm, list(prompt), params) for prompt in PROMPTS]


GREEDY = {"temperature": 0.0}  # generate_kwargs: --rollout.temperature 0 (one exact answer)


async def fresh_observations(checkpoint: Path, device: str) -> list[list[int]]:
    llm = await start_engine(checkpoint, device)
    try:
        return [observation for observation, _, _ in await rollout(llm, **GREEDY)]
    finally:
        llm.shutdown()


async def assert_logprobs_are_the_engines(llm: AsyncLLMEngine, samples: list[Any]) -> None:
    """Each rollout logprob is the token's under the served weights: the engine's own prompt
    logprobs of the whole observation (temperature 1, no top-k/p: processed equals raw)."""
    check = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for prompt, (observation, log_probs, _) in zip(PROMPTS, samples, strict=True):
        assert log_probs is not None and len(log_probs) == len(observation) > len(prompt)
        reference = await generate(llm, observation, check)
        expected = [reference.prompt_logprobs[i][observation[i]].logprob
                    for i in range(len(prompt), len(observation))]  # fmt: skip
        assert log_probs[len(prompt) :] == pytest.approx(expected, abs=2e-3)
        assert log_probs[: len(prompt)] == [0.0] * len(prompt) and max(log_probs) <= 0


async def assert_fully_awake(llm: AsyncLLMEngine) -> None:
    assert await llm.is_sleeping() is False
    assert await llm.asleep_tags() == ()


# ── the trainer's side ──────────────────────────────────────────────────────────────────────


def trained_weights(checkpoint: Path, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """What the DeepSpeed actor holds after a step (bf16 parameters, HF names): here, a
    checkpoint's tensors."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    return [(name, t.to(device=device, dtype=torch.bfloat16)) for name, t in tensors.items()]


def _broadcasting_trainer(port: int, conn: Connection) -> None:
    """ppo_actor.py L110-153 and L420-436 on DeepSpeed rank 0: joins the group as rank 0, then
    for each (checkpoint, number of tensors) asked for sends their (name, dtype, shape) and
    broadcasts each, in order."""
    import torch.distributed as dist

    from dormant.worker.update_group import create_update_group

    group = create_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo")
    while (asked := conn.recv()) is not None:
        checkpoint, count = asked
        named = trained_weights(checkpoint)[:count]
        conn.send([(name, param.dtype, param.shape) for name, param in named])
        for _, param in named:
            dist.broadcast(param.data, src=0, group=group)


def _ipc_trainer(checkpoint: Path, conn: Connection) -> None:
    """ppo_actor.py L438-465: each parameter cloned and shared as a CUDA IPC handle, keyed by
    the GPU's UUID; kept alive until the engine copied them."""
    from torch.multiprocessing.reductions import reduce_tensor

    from tests.frameworks.openrlhf_worker_wrap import physical_gpu_id

    keep, calls = [], []
    for name, param in trained_weights(checkpoint, "cuda"):
        weight = param.data.clone()
        keep.append(weight)
        ipc_handles = {physical_gpu_id(torch.cuda.current_device()): reduce_tensor(weight)}
        calls.append((name, param.dtype, param.shape, ipc_handles))
    conn.send(calls)
    conn.recv()


async def broadcast_to_vllm(llm: AsyncLLMEngine, trainer: Connection, checkpoint: Path) -> None:
    """ppo_actor.py L408-489 with one engine: reset the prefix cache, then per parameter
    ``update_weight`` (``empty_cache`` on the last) while rank 0 broadcasts it."""
    cache_reset = asyncio.ensure_future(llm.reset_prefix_cache())
    trainer.send((checkpoint, None))
    params = trainer.recv()
    for count, (name, dtype, shape) in enumerate(params, start=1):
        await llm.collective_rpc("update_weight", args=(name, dtype, shape, count == len(params)))
    await cache_reset


# ── the sequences ───────────────────────────────────────────────────────────────────────────


def test_openrlhf_imports_and_version_checks_under_install_as_vllm() -> None:
    """What OpenRLHF imports from vllm at start-up (vllm_engine.py L7-12, generator.py L7) and
    its version checks (L91-96, L298-300), in a fresh interpreter."""
    code = textwrap.dedent("""
        import dormant
        dormant.install_as_vllm()
        import vllm
        from packaging import version
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid
        assert version.parse(vllm.__version__) > version.parse("0.8.5")
        assert version.parse(vllm.__version__) >= version.parse("0.9.0")
        assert version.parse(vllm.__version__) > version.parse("0.10.0")
        args = vllm.AsyncEngineArgs(model="m", enable_sleep_mode=True, dtype="bfloat16")
        assert (args.model, args.enable_sleep_mode, args.dtype) == ("m", True, "bfloat16")
        assert callable(vllm.AsyncLLMEngine.from_engine_args)
        ids = {random_uuid() for _ in range(3)}
        assert len(ids) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
        assert TokensPrompt(prompt_token_ids=[1]) == {"prompt_token_ids": [1]}
        assert SamplingParams(top_k=-1, max_tokens=None, logprobs=1).max_tokens is None
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_openrlhf_colocated_steps_over_a_gloo_weight_update_group(checkpoints, spawn) -> None:
    """``--vllm.sync_backend gloo``: the broadcast path of ``broadcast_to_vllm`` (NCCL on
    GPUs). Two steps: new weights (checkpoint 2), then back (checkpoint 1); the second under
    the async trainer's ``pause_generation(mode="keep")`` / ``resume_generation()``."""

    async def run() -> None:
        expected = {seed: await fresh_observations(checkpoints[seed], "cpu") for seed in (1, 2)}
        assert expected[1] != expected[2]
        llm = await start_engine(checkpoints[1], "cpu")
        try:
            await llm.sleep(level=1)  # create_vllm_engines, L310-311
            port = free_port()
            trainer = spawn(_broadcasting_trainer, port)
            results = await llm.collective_rpc(
                "init_process_group", args=("127.0.0.1", port, 1, 2, GROUP, "gloo", False)
            )
            assert results == [None]  # one result per rank
            # Wrong order, asleep: generating, and loading a broadcast tensor, are refused
            # (the tensor is received first, as WorkerWrap does; nothing is written).
            with pytest.raises(EngineAsleepError):
                await rollout(llm)
            trainer.send((checkpoints[2], 1))
            ((name, dtype, shape),) = trainer.recv()
            with pytest.raises(EngineAsleepError, match="wake_up"):
                await llm.collective_rpc("update_weight", args=(name, dtype, shape, False))
            # Step 1: generate_samples, on the weights the engine woke with.
            await wake_up(llm)
            samples = await rollout(llm)
            await assert_logprobs_are_the_engines(llm, samples)
            assert all(len(obs) <= MAX_LEN for obs, _, _ in samples)
            assert [obs for obs, _, _ in await rollout(llm, **GREEDY)] == expected[1]
            await llm.sleep()
            # broadcast_to_vllm: the weights alone, then the refit.
            await llm.wake_up(tags=["weights"])
            with pytest.raises(EngineAsleepError):  # the KV cache is still asleep
                await rollout(llm)
            await broadcast_to_vllm(llm, trainer, checkpoints[2])
            await wake_up(llm)
            samples = await rollout(llm)
            await assert_logprobs_are_the_engines(llm, samples)
            assert [obs for obs, _, _ in await rollout(llm, **GREEDY)] == expected[2]
            # Step 2, the async trainer's way: pause (keep), refit, resume.
            await llm.pause_generation(mode="keep")
            await broadcast_to_vllm(llm, trainer, checkpoints[1])
            await llm.resume_generation()
            assert [obs for obs, _, _ in await rollout(llm, **GREEDY)] == expected[1]
            trainer.send(None)
            await assert_fully_awake(llm)
        finally:
            llm.shutdown()

    asyncio.run(run())


def test_pause_keep_freezes_a_rollout_and_resume_finishes_it(checkpoints) -> None:
    """``pause_generation(mode="keep")`` (vllm_engine.py L132-133) with a rollout running, as
    the async trainer pauses (ppo_trainer_async.py L259): it makes no progress and still counts
    as unfinished (generator.py L216) until ``resume_generation()``, then ends with the tokens
    of an uninterrupted run."""

    async def run() -> None:
        llm = await start_engine(checkpoints[1], "cpu")
        try:
            params = sampling_params(temperature=0.0, max_new_tokens=200)
            uninterrupted = await generate(llm, PROMPTS[0], params)
            progress: list[int] = []

            async def stream() -> Any:
                prompt = TokensPrompt(prompt_token_ids=PROMPTS[0])
                final = None
                async for final in llm.generate(prompt, deepcopy(params), random_uuid()):
                    progress.append(len(final.outputs[0].token_ids))
                return final

            task = asyncio.ensure_future(stream())
            while not progress:
                await asyncio.sleep(0.01)
            await llm.pause_generation(mode="keep")
            frozen = len(progress)
            await asyncio.sleep(0.3)
            assert len(progress) == frozen and progress[-1] < 200
            assert llm.output_processor.get_num_unfinished_requests() == 1
            await llm.resume_generation()
            output = await task
            assert output.outputs[0].token_ids == uninterrupted.outputs[0].token_ids
            assert llm.output_processor.get_num_unfinished_requests() == 0
            await assert_fully_awake(llm)
        finally:
            llm.shutdown()

    asyncio.run(run())


@pytest.mark.gpu
def test_openrlhf_colocated_step_over_cuda_ipc(checkpoints, spawn) -> None:
    """``--colocate_all`` with NCCL: ``update_weight_cuda_ipc`` per parameter, the handles
    from the trainer's process on the same GPU (ppo_actor.py L438-465)."""

    async def run() -> None:
        expected = await fresh_observations(checkpoints[2], "cuda")
        llm = await start_engine(checkpoints[1], "cuda")
        try:
            await llm.sleep(level=1)
            await wake_up(llm)
            assert [obs for obs, _, _ in await rollout(llm, **GREEDY)] != expected
            await llm.sleep()
            await llm.wake_up(tags=["weights"])
            trainer = spawn(_ipc_trainer, checkpoints[2])
            calls = trainer.recv()
            for count, (name, dtype, shape, ipc_handles) in enumerate(calls, start=1):
                args = (name, dtype, shape, ipc_handles, count == len(calls))
                await llm.collective_rpc("update_weight_cuda_ipc", args=args)
            trainer.send(None)
            await wake_up(llm)
            assert [obs for obs, _, _ in await rollout(llm, **GREEDY)] == expected
            await assert_fully_awake(llm)
        finally:
            llm.shutdown()

    asyncio.run(run())
