"""The Ray executor (``distributed_executor_backend="ray"``, issue #21) on a local Ray cluster, TP=2
over gloo: the RL cycle through every refit path with identical tokens, ``collective_rpc`` into
a worker extension and with callables (results in rank order), the async engine; a worker
killed mid-call is ``EngineDeadError`` and leaves no actor behind, and so does a driver that dies;
without Ray, choosing it names the extra to install."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from dormant import LLM, AsyncLLM
from dormant.engine import EngineDeadError, UnsupportedOptionError
from dormant.executors.multiproc import free_port
from dormant.worker.ipc_weights import FLATTENED_BUCKET, flattened_bucket_request
from dormant.worker.update_group import broadcast_weights, create_update_group
from tests.engine.conftest import (
    GREEDY,
    PROMPTS,
    SEEDED,
    hf_config,
    hf_state_dict,
    write_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)
RAY = dict(tensor_parallel_size=2, distributed_executor_backend="ray", **OPTIONS)
EXTENSION = "tests.engine.worker_extensions.RefitExtension"


def tokens(llm: LLM, params=GREEDY) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def gone(pids: list[int], within_s: float = 30.0) -> bool:
    """Whether every pid exits (or is a zombie) within ``within_s``."""

    def is_gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + within_s
    while not all(is_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return all(is_gone(pid) for pid in pids)


def _trainer(port: int, world_size: int, seed: int, conn: Connection) -> None:
    """Rank 0 of a weight-update group with every engine rank: broadcasts hf_state_dict(seed),
    then stays in the group until the engine left it. (Exiting at once, with the engine's gloo
    peers still connected, sometimes ended in gloo's "terminate called without an active
    exception": SIGABRT.)"""
    group = create_update_group("127.0.0.1", port, 0, world_size, "refit", "gloo", timeout_s=60)
    broadcast_weights(group, list(hf_state_dict(seed).items()), timeout_s=60)
    conn.recv()
    dist.destroy_process_group(group)


def broadcast_refit(llm: LLM, seed: int) -> None:
    """SGLang's weight-update group, as slime and OpenRLHF drive it: the trainer is rank 0 and
    engine TP rank t joins as 1 + t; the trainer broadcasts every weight."""
    port, world_size = free_port(), 1 + llm.llm_engine.executor.world_size
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    trainer = context.Process(target=_trainer, args=(port, world_size, seed, child))
    trainer.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, world_size, "refit", backend="gloo")
        names, weights = zip(*hf_state_dict(seed).items(), strict=True)
        dtypes, shapes = [w.dtype for w in weights], [list(w.shape) for w in weights]
        llm.update_weights_from_distributed(names, dtypes, shapes, "refit")
        llm.destroy_weights_update_group("refit")
    finally:
        conn.send("done")
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return (
        write_checkpoint(tmp_path_factory.mktemp("ray_a"), seed=1),
        write_checkpoint(tmp_path_factory.mktemp("ray_b"), seed=2),
    )


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list]:
    """One in-process rank's tokens on weights a and b (TP=2 equals TP=1: test_tp_engine.py)."""
    result = {}
    for name, path in zip("ab", checkpoints, strict=True):
        with LLM(str(path), **OPTIONS) as llm:
            result[name] = tokens(llm)
            result[f"{name}_seeded"] = tokens(llm, SEEDED)
    return result


@pytest.fixture(scope="module")
def ray_llm(ray_cluster, checkpoints) -> Iterator[LLM]:
    llm = LLM(str(checkpoints[0]), worker_extension_cls=EXTENSION, **RAY)
    yield llm
    llm.shutdown()


def test_workers_are_ray_actors_answering_in_rank_order(ray_llm: LLM, expected) -> None:
    executor = ray_llm.llm_engine.executor
    assert type(executor).__name__ == "RayExecutor" and executor.world_size == 2
    assert os.getpid() not in executor.pids and len(set(executor.pids)) == 2
    assert ray_llm.collective_rpc(lambda worker: (worker.rank, os.getpid())) == [
        (0, executor.pids[0]),
        (1, executor.pids[1]),
    ]
    assert ray_llm.collective_rpc("check_health") == [True, True]
    assert tokens(ray_llm) == expected["a"]
    assert tokens(ray_llm, SEEDED) == expected["a_seeded"]


def test_rl_cycle_through_every_refit_path(ray_llm: LLM, expected) -> None:
    """Level 2, then each refit path the frameworks use: tensors, a flattened bucket of IPC
    handles, a weight-update group broadcast from a trainer process, and a reload."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU handles for Ray's actors

    def level_2_refit(refit, want: list) -> None:
        ray_llm.sleep(level=2)
        statuses = ray_llm.memory_status()
        assert [s.tag("weights").mapped_bytes for s in statuses] == [0, 0]
        assert ray_llm.wake_up(["weights"]) is False
        refit()
        assert ray_llm.wake_up(["kv_cache"]) is True
        assert tokens(ray_llm) == want

    try:
        level_2_refit(lambda: ray_llm.update_weights(hf_state_dict(2)), expected["b"])
        entries, flat = flattened_bucket_request(list(hf_state_dict(1).items()))
        load = dict(load_format=FLATTENED_BUCKET, weight_version="ipc")
        level_2_refit(lambda: ray_llm.update_weights_from_tensor(entries, **load), expected["a"])
        del flat
        level_2_refit(lambda: broadcast_refit(ray_llm, seed=2), expected["b"])
        level_2_refit(lambda: ray_llm.collective_rpc("reload_weights"), expected["a"])
    finally:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
    ray_llm.sleep(level=1)
    ray_llm.wake_up()
    assert tokens(ray_llm) == expected["a"]


def test_collective_rpc_into_a_worker_extension(ray_llm: LLM, expected) -> None:
    assert ray_llm.collective_rpc("where_am_i") == [(0, "cpu"), (1, "cpu")]
    ray_llm.sleep(level=2)
    ray_llm.wake_up(["weights"])
    assert ray_llm.collective_rpc("refit_from_state_dict", args=(hf_state_dict(2),)) == [0, 1]
    ray_llm.wake_up(["kv_cache"])
    assert tokens(ray_llm) == expected["b"]
    ray_llm.reload_weights()
    assert tokens(ray_llm) == expected["a"]


def test_a_worker_killed_mid_call_is_engine_dead_and_leaves_no_actor(
    ray_cluster, checkpoints, monkeypatch
) -> None:
    from ray.util import placement_group_table

    def die_mid_collective(worker) -> None:
        """Rank 1 is killed; rank 0 waits for it in an all-reduce it will never join."""
        if worker.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        torch.distributed.all_reduce(torch.ones(1))

    monkeypatch.setattr("dormant.executors.ray_executor.COMMAND_TIMEOUT_S", 120.0)  # no hang
    llm = LLM(str(checkpoints[0]), **RAY)
    executor = llm.llm_engine.executor
    group = executor.placement.placement_group
    with pytest.raises(EngineDeadError, match="worker rank 1 died"):
        llm.collective_rpc(die_mid_collective)
    assert gone(executor.pids)  # rank 0, stuck in the all-reduce, was killed too
    assert placement_group_table(group)["state"] == "REMOVED"  # dormant made it: removed
    with pytest.raises(EngineDeadError, match="create a new engine"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()


def test_no_actor_outlives_a_killed_driver(ray_cluster, checkpoints, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids.json"
    address = ray_cluster.get_runtime_context().gcs_address
    script = textwrap.dedent(f"""
        import json, time, ray
        from dormant import LLM
        ray.init(address={address!r}, log_to_driver=False)
        llm = LLM({str(checkpoints[0])!r}, **{RAY!r})
        open({str(pid_file)!r}, "w").write(json.dumps(llm.llm_engine.executor.pids))
        time.sleep(600)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    deadline = time.monotonic() + 240
    while not pid_file.exists() and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.2)
    assert pid_file.exists(), "the engine did not start"
    pids = json.loads(pid_file.read_text())
    assert not gone(pids, within_s=0)
    driver.kill()
    driver.wait()
    assert gone(pids)  # Ray ends the actors of a dead owner


def test_the_async_engine_over_ray(ray_llm: LLM, expected) -> None:
    """Last in this module: AsyncLLM's shutdown ends the engine it wraps."""
    engine = AsyncLLM(ray_llm)

    async def generate(index: int) -> tuple[int, ...]:
        final = None
        async for output in engine.generate(PROMPTS[index], GREEDY, f"req-{index}"):
            final = output
        assert final is not None
        return final.outputs[0].token_ids

    async def cycle() -> list[list[tuple[int, ...]]]:
        first = await asyncio.gather(*(generate(i) for i in range(len(PROMPTS))))
        await engine.sleep(level=2)
        await engine.wake_up(["weights"])
        await engine.update_weights(hf_state_dict(2))
        await engine.wake_up(["kv_cache"])
        ranks = await engine.collective_rpc("where_am_i")
        assert ranks == [(0, "cpu"), (1, "cpu")]
        return [list(first), list(await asyncio.gather(*(generate(i) for i in range(3))))]

    try:
        assert asyncio.run(cycle()) == [expected["a"], expected["b"]]
    finally:
        engine.shutdown()


def test_without_ray_the_error_names_the_extra(monkeypatch) -> None:
    from dormant.models import ModelConfig

    model = ModelConfig.from_dict(hf_config().to_dict())
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(UnsupportedOptionError, match=r"pip install 'dormant\[ray\]'"):
        LLM(model, distributed_executor_backend="ray", **OPTIONS)
    with pytest.raises(UnsupportedOptionError, match="distributed_executor_backend='ray'"):
        LLM(model, distributed_executor_backend="mp", placement_group=object(), **OPTIONS)
