"""verl's rollout calls, in verl's order, against dormant's ``AsyncLLM`` (issue #15).

Read from volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7 (``vas`` below is
``verl/workers/rollout/vllm_rollout/vllm_async_server.py``, ``vr`` is ``vllm_rollout.py`` and
``utils`` is ``utils.py`` beside them, ``ew`` is ``verl/workers/engine_workers.py``):

    step                         verl's call                                      where
    ───────────────────────────  ───────────────────────────────────────────────  ────────────
    start the engine             AsyncLLM from the engine args (dtype, load_format vas L264-289,
                                 "dummy", worker_extension_cls, prefix caching,   L392-404
                                 sleep mode, logprobs_mode ...)
                                 reset_mm_cache()                                 vas L407
                                 collective_rpc(method="monkey_patch_model",      vas L408-410
                                 kwargs={"vocab_size": len(tokenizer)})
    sleep (sleep_replicas)       wait_for_requests_to_drain()                     vas L794
                                 collective_rpc("sleep", kwargs={"level": 2})     vas L569
    refit (update_weights)       collective_rpc(method="wake_up", timeout=None,   ew L587, vr
                                 args=(), kwargs={"tags": ["weights"]})           L138, vas L190
                                 collective_rpc(method="update_weights_from_ipc", ew L595, vr
                                 kwargs={"peft_config": None,                     L148-153
                                 "base_sync_done": True}), while the trainer
                                 sends IPC buckets                                vr L155-207
                                 reset_prefix_cache()                             vr L211, vas
                                                                                  L595-597
                                 collective_rpc(method="wake_up", ...,            ew L620
                                 kwargs={"tags": ["kv_cache"]})
    rollout (generate)           SamplingParams(max_tokens=..., temperature,      vas L457-482,
                                 top_p, top_k=-1, repetition_penalty=1.0,         agent_loop.py
                                 logprobs=0)                                      L428-434
                                 TokensPrompt(prompt_token_ids=...,               vas L490
                                 multi_modal_data={})
                                 generate(prompt=, sampling_params=,              vas L504-516
                                 request_id=, lora_request=None, priority=0)
                                 outputs[0].token_ids,                            vas L518-539
                                 logprobs[i][token_ids[i]].logprob,
                                 finish_reason, hasattr(..., "num_preempted")

verl's validation sampling (``val_kwargs``: temperature 0, ``rollout.yaml`` L132-151) gives
the greedy rollouts compared with a fresh engine on the same weights. The worker extension and
the trainer's bucket sender are in ``verl_colocate.py``. Not taken: verl starts the engine
through vLLM's CLI parser and OpenAI server (``vas`` L363-421); here ``AsyncLLM.from_engine_args``
takes the same engine args. ``override_generation_config`` (L283) is not passed: dormant has no
default-generation-config layer (verl's requests carry all their sampling parameters).
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from dormant.core.errors import EngineAsleepError, WeightsNotLoadedError
from dormant.engine.async_llm import AsyncLLM
from dormant.memory import TagState
from tests.engine.conftest import PROMPTS, hf_state_dict, write_checkpoint
from tests.frameworks import verl_server
from tests.frameworks.verl_colocate import (
    EXTENSION,
    SOCKET_ENV,
    send_weights_in_buckets,
    sender_process,
)

# vas L264-289 with rollout.yaml's defaults; dtype is the checkpoint's float32 here (verl's
# default is bfloat16), and the last line sizes the engine for the CPU (dormant's options).
VERL_ENGINE_ARGS = dict(
    dtype="float32", load_format="dummy", skip_tokenizer_init=False,
    distributed_executor_backend="mp", worker_extension_cls=EXTENSION,
    trust_remote_code=False, max_model_len=256, max_num_seqs=256, enable_chunked_prefill=True,
    max_num_batched_tokens=8192, enable_prefix_caching=True, enable_sleep_mode=True,
    logprobs_mode="processed_logprobs", enforce_eager=False, gpu_memory_utilization=0.5,
    disable_log_stats=True, tensor_parallel_size=1, seed=0, quantization=None,
    hf_overrides={}, scheduling_policy="fcfs",
    compilation_config=json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY"}),
    device="cpu", kv_cache_memory_bytes=4 << 20,
)  # fmt: skip
TRAIN_SAMPLING = dict(temperature=1.0, top_p=1, top_k=-1, repetition_penalty=1.0, logprobs=True)
VAL_SAMPLING = dict(temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
RESPONSE_LENGTH = 12
BUCKET_BYTES = 160 << 10  # the tiny model's weights fill several buckets


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The checkpoint verl starts from (its config; the weights are dummy) and one per seed
    the trainer sends, for the fresh engines."""
    return {
        seed: write_checkpoint(tmp_path_factory.mktemp(f"verl{seed}"), seed) for seed in (1, 2, 3)
    }


@pytest.fixture
def socket_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = str(tmp_path / "refit.sock")
    monkeypatch.setenv(SOCKET_ENV, path)
    return path


def start_engine(model: Path, **overrides: Any) -> AsyncLLM:
    return AsyncLLM.from_engine_args({"model": str(model), **VERL_ENGINE_ARGS, **overrides})


async def launch(engine: AsyncLLM, model: Path) -> None:
    """vas L404-410, once the engine is up."""
    await engine.reset_mm_cache()
    vocab_size = len(AutoTokenizer.from_pretrained(str(model)))
    await engine.collective_rpc(method="monkey_patch_model", kwargs={"vocab_size": vocab_size})


async def verl_generate(
    engine: AsyncLLM, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str
) -> dict[str, Any]:
    """vas L445-547 with the rollout's response length (``verl_server.verl_generate``)."""
    sampling = {"max_tokens": RESPONSE_LENGTH, **sampling_params}
    return await verl_server.verl_generate(engine, prompt_ids, sampling, request_id)


async def rollout(engine: AsyncLLM, sampling: dict[str, Any], tag: str) -> list[dict[str, Any]]:
    """The agent loop's requests, concurrent, one per prompt."""
    calls = [verl_generate(engine, list(p), sampling, f"{tag}-{i}") for i, p in enumerate(PROMPTS)]
    return list(await asyncio.gather(*calls))


async def sleep_replicas(engine: AsyncLLM) -> None:
    """vas L791-795 and L563-569 (hybrid mode)."""
    await engine.wait_for_requests_to_drain()
    await engine.collective_rpc("sleep", kwargs={"level": 2})


async def refit(engine: AsyncLLM, socket: str, seed: int) -> int:
    """ew L584-621 with ServerAdapter's resume / update_weights (vr L131-214): the trainer's
    tensors (fp32, cast to the rollout dtype) arrive in IPC buckets; returns the bucket count."""
    await resume(engine, ["weights"])
    receiving = asyncio.create_task(
        engine.collective_rpc(
            method="update_weights_from_ipc", timeout=None, args=(),
            kwargs={"peft_config": None, "base_sync_done": True},
        )
    )  # fmt: skip
    weights = hf_state_dict(seed).items()
    device = torch.device("cpu")
    num_buckets = await asyncio.to_thread(
        send_weights_in_buckets, socket, weights, BUCKET_BYTES, torch.float32, device
    )
    await receiving
    assert await engine.reset_prefix_cache() is True
    await resume(engine, ["kv_cache"])
    return num_buckets


async def resume(engine: AsyncLLM, tags: list[str]) -> None:
    """vr L131-138 through the server's collective_rpc (vas L183-195)."""
    await engine.collective_rpc(method="wake_up", timeout=None, args=(), kwargs={"tags": tags})


async def assert_fully_awake(engine: AsyncLLM) -> None:
    assert not await engine.is_sleeping()
    assert await engine.asleep_tags() == ()
    (status,) = await engine.memory_status()
    assert {tag.state for tag in status.tags} == {TagState.AWAKE}, status.table()


def fresh_rollout(model: Path) -> list[dict[str, Any]]:
    """A new engine loading ``model`` from disk, launched as verl launches it."""

    async def run() -> list[dict[str, Any]]:
        engine = start_engine(model, load_format="auto")
        try:
            await launch(engine, model)
            return await rollout(engine, VAL_SAMPLING, "fresh")
        finally:
            engine.shutdown()

    return asyncio.run(run())


def test_verl_hybrid_cycles_refit_from_ipc_buckets(checkpoints, socket_path) -> None:
    """Two training steps: each sleeps at level 2, refits new weights through the worker
    extension's bucket protocol, wakes the KV cache and rolls out; the greedy rollouts equal a
    fresh engine's on those weights, logprobs and all, and nothing is left asleep."""
    expected = {seed: fresh_rollout(checkpoints[seed]) for seed in (2, 3)}
    vocab_size = len(AutoTokenizer.from_pretrained(str(checkpoints[1])))

    async def run() -> dict[str, Any]:
        engine = start_engine(checkpoints[1])
        seen: dict[str, Any] = {}
        try:
            await launch(engine, checkpoints[1])
            for seed in (2, 3):
                await sleep_replicas(engine)
                seen[f"buckets{seed}"] = await refit(engine, socket_path, seed)
                await assert_fully_awake(engine)
                seen[f"val{seed}"] = await rollout(engine, VAL_SAMPLING, f"val{seed}")
                seen[f"train{seed}"] = await rollout(engine, TRAIN_SAMPLING, f"train{seed}")
        finally:
            engine.shutdown()
        return seen

    seen = asyncio.run(run())
    for seed in (2, 3):
        assert seen[f"buckets{seed}"] > 1
        got, want = seen[f"val{seed}"], expected[seed]
        assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
        for g, w in zip(got, want, strict=True):
            assert g["log_probs"] == pytest.approx(w["log_probs"], abs=1e-5)
        assert expected[2] != expected[3]  # the refits changed what is generated
        for result in seen[f"train{seed}"]:
            tokens, log_probs = result["token_ids"], result["log_probs"]
            assert 1 <= len(tokens) <= RESPONSE_LENGTH and len(log_probs) == len(tokens)
            assert all(math.isfinite(lp) and lp <= 0 for lp in log_probs)
            assert all(t < vocab_size for t in tokens)  # monkey_patch_model's mask holds
            assert result["stop_reason"] == "completed"


def test_verl_calls_in_the_wrong_order_get_typed_errors(checkpoints, socket_path) -> None:
    """Generating after ``sleep(level=2)``, refitting before ``wake_up(tags=["weights"])``,
    and generating after both wakes with no refit: each is refused with a typed error and
    changes nothing; the right order then works."""

    async def run() -> list[dict[str, Any]]:
        engine = start_engine(checkpoints[1])
        try:
            await launch(engine, checkpoints[1])
            await sleep_replicas(engine)
            with pytest.raises(EngineAsleepError):
                await verl_generate(engine, list(PROMPTS[0]), VAL_SAMPLING, "asleep")
            asleep = await engine.asleep_tags()
            await refit_while_asleep(engine, socket_path)
            assert await engine.asleep_tags() == asleep  # the refused refit changed nothing
            await resume(engine, ["weights"])
            await resume(engine, ["kv_cache"])
            with pytest.raises(WeightsNotLoadedError):
                await verl_generate(engine, list(PROMPTS[0]), VAL_SAMPLING, "no-refit")
            await sleep_replicas(engine)
            await refit(engine, socket_path, 2)
            return await rollout(engine, VAL_SAMPLING, "after")
        finally:
            engine.shutdown()

    got = asyncio.run(run())
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in fresh_rollout(checkpoints[2])]


async def refit_while_asleep(engine: AsyncLLM, socket: str) -> None:
    """The extension's ``model.load_weights`` with the weights asleep: EngineAsleepError from
    the worker (not a crash); the trainer's sender sees the connection close."""
    receiving = engine.collective_rpc(
        method="update_weights_from_ipc", kwargs={"peft_config": None, "base_sync_done": True}
    )
    sender_error: list[BaseException] = []

    def send() -> None:
        try:
            send_weights_in_buckets(
                socket, hf_state_dict(2).items(), BUCKET_BYTES, torch.float32,
                torch.device("cpu"),
            )  # fmt: skip
        except (EOFError, ConnectionError) as error:
            sender_error.append(error)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    with pytest.raises(EngineAsleepError, match="wake_up"):
        await receiving
    await asyncio.to_thread(sender.join, 60)
    assert not sender.is_alive() and sender_error  # the worker hung up after one bucket


@pytest.mark.gpu
def test_verl_refit_from_cuda_ipc_buckets_on_the_gpu(checkpoints, socket_path) -> None:
    """The same cycle on the GPU (``enforce_eager=False``: decode graphs are captured): the
    trainer is another process and sends ``reduce_tensor`` handles of its bucket buffer (vr
    L158-159); the worker rebuilds them on its device (utils L101-109, L176). The greedy
    rollouts equal a fresh engine's, and ``monkey_patch_model``'s mask holds: once
    ``compute_logits`` is replaced, dormant runs decode eagerly (its graphs baked in the
    original), so no id past the tokenizer's vocabulary is ever sampled."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gpu = dict(device="cuda", kv_cache_memory_bytes=16 << 20)
    vocab_size = len(AutoTokenizer.from_pretrained(str(checkpoints[1])))

    async def fresh() -> list[dict[str, Any]]:
        engine = start_engine(checkpoints[2], load_format="auto", **gpu)
        try:
            await launch(engine, checkpoints[2])
            return await rollout(engine, VAL_SAMPLING, "fresh")
        finally:
            engine.shutdown()

    async def cycle() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        engine = start_engine(checkpoints[1], **gpu)
        try:
            await launch(engine, checkpoints[1])
            await sleep_replicas(engine)
            await resume(engine, ["weights"])
            context = mp.get_context("spawn")
            result, child = context.Pipe()
            trainer = context.Process(
                target=sender_process, args=(socket_path, 2, BUCKET_BYTES, child)
            )
            trainer.start()
            try:
                await engine.collective_rpc(
                    method="update_weights_from_ipc", timeout=None, args=(),
                    kwargs={"peft_config": None, "base_sync_done": True},
                )  # fmt: skip
                num_buckets = result.recv()
            finally:
                trainer.join(timeout=60)
            assert await engine.reset_prefix_cache() is True
            await resume(engine, ["kv_cache"])
            await assert_fully_awake(engine)
            val = await rollout(engine, VAL_SAMPLING, "val")
            train = await rollout(engine, TRAIN_SAMPLING, "train")
            return val, train, num_buckets
        finally:
            engine.shutdown()

    expected = asyncio.run(fresh())
    torch.cuda.empty_cache()
    val, train, num_buckets = asyncio.run(cycle())
    assert num_buckets > 1
    assert [g["token_ids"] for g in val] == [w["token_ids"] for w in expected]
    for g, w in zip(val, expected, strict=True):
        assert g["log_probs"] == pytest.approx(w["log_probs"], abs=1e-4)
    assert all(t < vocab_size for result in val + train for t in result["token_ids"])


@pytest.fixture(autouse=True)
def _no_socket_left(socket_path: str) -> Iterator[None]:
    yield
    assert not Path(socket_path).exists()  # the trainer's listener removed its socket
