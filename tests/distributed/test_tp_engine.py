"""Tensor parallelism on the CPU (gloo, TP=2): the engine's outputs and its lifecycle equal TP=1,
a dead worker fails loudly, and no worker outlives its engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.engine import EngineDeadError
from dormant.executors.multiproc import free_port
from tests.engine.conftest import GREEDY, PROMPTS, SEEDED, hf_state_dict, write_checkpoint

REPO = Path(__file__).resolve().parents[2]
OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)
KEEP = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return (
        write_checkpoint(tmp_path_factory.mktemp("tp_a"), seed=1),
        write_checkpoint(tmp_path_factory.mktemp("tp_b"), seed=2),
    )


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list]:
    """What one rank produces: the reference for every TP=2 result."""
    a, b = checkpoints
    with LLM(str(a), **OPTIONS) as llm:
        result = {"greedy": tokens(llm), "seeded": tokens(llm, SEEDED)}
        engine = llm.llm_engine
        ids = [engine.add_request(p, KEEP) for p in PROMPTS]
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
        result["keep"] = [outs[str(i)].outputs[0].token_ids for i in ids]
    with LLM(str(b), **OPTIONS) as llm:
        result["greedy_b"] = tokens(llm)
    return result


@pytest.fixture(scope="module")
def tp2(checkpoints) -> Iterator[LLM]:
    llm = LLM(str(checkpoints[0]), tensor_parallel_size=2, **OPTIONS)
    yield llm
    llm.shutdown()


def test_tp2_outputs_equal_tp1(tp2: LLM, expected) -> None:
    assert tp2.llm_engine.executor.world_size == 2
    assert tokens(tp2) == expected["greedy"]
    assert tokens(tp2, SEEDED) == expected["seeded"]
    assert tp2.collective_rpc("check_health") == [True, True]


def test_tp2_queues_calls_ahead_and_reads_every_reply_in_order(tp2: LLM, expected) -> None:
    """Async scheduling over worker processes (``async_scheduling=True``; the setter here, on
    the module's engine): a step is sent before the replies of the one in flight are read; a
    read-only command between steps (the memory status, which does not drain) first reads the
    replies still in the pipes, so each call gets its own."""
    engine, executor = tp2.llm_engine, tp2.llm_engine.executor
    assert not engine.async_scheduling  # not a default over processes yet
    engine.async_scheduling = True
    launch, seen = executor.launch, []

    def recording(step, multi_step=False):  # type: ignore[no-untyped-def]
        seen.append(step)
        return launch(step, multi_step)

    executor.launch = recording  # type: ignore[method-assign]
    try:
        ids = [engine.add_request(p, KEEP) for p in PROMPTS]
        outs: dict[str, object] = {}
        for _ in range(3):
            outs.update({o.request_id: o for o in engine.step()})
        assert engine.num_calls_in_flight == 1  # a call in flight
        assert len(tp2.memory_status()) == 2
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
    finally:
        del executor.launch
        engine.async_scheduling = False
    assert [outs[str(i)].outputs[0].token_ids for i in ids] == expected["keep"]  # type: ignore[attr-defined]
    assert sum(step.previous_rows is not None for step in seen) > 0


def test_tp2_level_1_cycle(tp2: LLM, expected) -> None:
    tp2.sleep(level=1)
    statuses = tp2.memory_status()
    assert len(statuses) == 2
    assert all(s.tag("weights").state == "offloaded" for s in statuses)
    assert all(s.tag("kv_cache").mapped_bytes == 0 for s in statuses)
    tp2.wake_up()
    assert tokens(tp2) == expected["greedy"]


def test_tp2_level_2_reload(tp2: LLM, expected) -> None:
    tp2.sleep(level=2)
    tp2.wake_up(["weights"])
    tp2.collective_rpc("reload_weights")
    tp2.wake_up(["kv_cache"])
    assert tokens(tp2) == expected["greedy"]


def test_tp2_level_2_update_weights(tp2: LLM, expected, checkpoints) -> None:
    tp2.sleep(level=2)
    tp2.wake_up(["weights"])
    tp2.update_weights(hf_state_dict(2))  # every rank takes its shard of the full tensors
    tp2.wake_up(["kv_cache"])
    assert tokens(tp2) == expected["greedy_b"]
    tp2.reload_weights()  # back to the checkpoint, for the tests that follow
    assert tokens(tp2) == expected["greedy"]


def test_tp2_keep_mode_resumes(tp2: LLM, expected) -> None:
    engine = tp2.llm_engine
    ids = [engine.add_request(p, KEEP) for p in PROMPTS]
    outs = {}
    for _ in range(4):
        outs.update({o.request_id: o for o in engine.step()})
    engine.sleep(level=1, mode="keep")
    tp2.wake_up()
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert [outs[str(i)].outputs[0].token_ids for i in ids] == expected["keep"]


def test_tp2_fp8_scales_survive_level_2(checkpoints, tmp_path: Path) -> None:
    scales = {
        f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(v)
        for i in range(2)
        for n, v in (("k", 0.5), ("v", 0.25))
    }
    path = write_checkpoint(tmp_path / "fp8", seed=1, extra=scales)
    with LLM(str(path), tensor_parallel_size=2, kv_cache_dtype="fp8", **OPTIONS) as llm:
        assert llm.collective_rpc("kv_cache_scales") == [[(0.5, 0.25)] * 2] * 2
        before = tokens(llm)
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        llm.update_weights(hf_state_dict(1))  # parameters only: the scales are not refit
        llm.wake_up(["kv_cache"])
        assert llm.collective_rpc("kv_cache_scales") == [[(0.5, 0.25)] * 2] * 2
        assert tokens(llm) == before


def test_killed_worker_raises_and_shuts_the_others_down(checkpoints) -> None:
    llm = LLM(str(checkpoints[0]), tensor_parallel_size=2, **OPTIONS)
    executor = llm.llm_engine.executor
    os.kill(executor.pids[1], signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.generate(PROMPTS, GREEDY)
    assert not any(p.is_alive() for p in executor.processes)
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS, GREEDY)
    llm.shutdown()


def _is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_no_worker_outlives_a_killed_parent(checkpoints, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids.json"
    script = textwrap.dedent(f"""
        import json, time
        from dormant import LLM
        llm = LLM({str(checkpoints[0])!r}, tensor_parallel_size=2, **{OPTIONS!r})
        open({str(pid_file)!r}, "w").write(json.dumps(llm.llm_engine.executor.pids))
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 180
    while not pid_file.exists() and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.2)
    assert pid_file.exists(), "the engine did not start"
    pids = json.loads(pid_file.read_text())
    assert not any(_is_gone(pid) for pid in pids)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while not all(_is_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_is_gone(pid) for pid in pids)


def test_external_launcher_under_torchrun(checkpoints, expected, tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, os, sys
        from dormant import LLM
        from tests.engine.conftest import GREEDY, PROMPTS
        backend = "external_launcher"
        llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend=backend,
                  **{OPTIONS!r})
        first = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(["kv_cache"])
        second = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        with open(os.path.join(sys.argv[2], "rank" + os.environ["RANK"] + ".json"), "w") as f:
            json.dump([first, second], f)
        llm.shutdown()
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(script),
        str(checkpoints[0]),
        str(tmp_path),
    ]
    subprocess.run(command, env=env, check=True, timeout=600, cwd=REPO)
    want = [list(t) for t in expected["greedy"]]
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [want, want]


def test_tp2_bad_calls_raise_typed_errors_from_the_workers(tp2: LLM, expected) -> None:
    from dormant.engine import WeightsNotLoadedError
    from dormant.memory import UnknownTagError
    from dormant.models import WeightError

    bad = hf_state_dict(2)
    bad["model.norm.weight"] = torch.ones(65)
    with pytest.raises(WeightError, match=r"model\.norm\.weight"):  # raised in the workers
        tp2.update_weights(bad)
    with pytest.raises(UnknownTagError, match="kv_cahce"):
        tp2.wake_up(["kv_cahce"])
    tp2.sleep(level=2)
    tp2.wake_up()
    with pytest.raises(WeightsNotLoadedError):
        tp2.generate(PROMPTS, GREEDY)
    tp2.reload_weights()
    assert tokens(tp2) == expected["greedy"]


def test_typed_errors_survive_pickling() -> None:
    """Regression: errors with extra constructor arguments came back from a worker as
    RemoteError, not as themselves."""
    import pickle

    from dormant.memory import WakeOutOfMemoryError
    from dormant.models import WeightError

    weight = pickle.loads(pickle.dumps(WeightError(["a: wrong shape"], "nothing written")))
    assert isinstance(weight, WeightError) and weight.problems == ("a: wrong shape",)
    oom = pickle.loads(pickle.dumps(WakeOutOfMemoryError("no room", 10, 3)))
    assert isinstance(oom, WakeOutOfMemoryError) and (oom.bytes_requested, oom.bytes_free) == (
        10,
        3,
    )


def test_tp2_poison_mode_and_abort_and_wait(checkpoints, expected) -> None:
    with LLM(str(checkpoints[0]), tensor_parallel_size=2, memory_poison=True, **OPTIONS) as llm:
        for level in (1, 2):
            llm.sleep(level=level)
            llm.wake_up(["weights"])
            if level == 2:
                llm.reload_weights()
            llm.wake_up(["kv_cache"])
            assert tokens(llm) == expected["greedy"]
        engine = llm.llm_engine
        ids = [engine.add_request(p, KEEP) for p in PROMPTS]
        engine.step()
        aborted = engine.sleep(level=1, mode="abort")
        assert sorted(o.request_id for o in aborted) == sorted(str(i) for i in ids)
        assert all(o.outputs[0].finish_reason == "abort" for o in aborted)
        llm.wake_up()
        ids = [engine.add_request(p, KEEP) for p in PROMPTS]
        engine.step()
        drained = {o.request_id: o for o in engine.sleep(level=1, mode="wait")}
        assert [drained[str(i)].outputs[0].token_ids for i in ids] == expected["keep"]
        llm.wake_up()


def test_tp2_collective_rpc_returns_one_result_per_rank(tp2: LLM, expected) -> None:
    """Every allowlisted method answers with a list of two results, in rank order."""
    from dormant.core.commands import PUBLIC_RPC
    from dormant.core.sleep_state import RankSleepState

    update = list(hf_state_dict(1).items())[:2]
    args = {"sleep": [1], "update_weights": [update]}
    for method in PUBLIC_RPC:
        results = tp2.collective_rpc(method, args=args.get(method, []))
        assert isinstance(results, list) and len(results) == 2, method
        if method in ("sleep", "wake_up", "sleep_state"):
            assert all(isinstance(r, RankSleepState) for r in results), method
    assert tp2.wake_up() is True
    assert tokens(tp2) == expected["greedy"]


def test_tp2_pause_release_then_sleep_deeper(tp2: LLM, expected) -> None:
    tp2.sleep(level=0)
    tp2.release_memory_occupation(["kv_cache"])
    tp2.sleep(level=2)
    assert tp2.wake_up(["weights"]) is False
    tp2.collective_rpc("reload_weights")
    assert tp2.wake_up(["kv_cache"]) is True
    assert tokens(tp2) == expected["greedy"]


def test_tp2_worker_extension_and_callable(checkpoints, expected) -> None:
    """An extension's refit and a callable reach both ranks (gloo), results in rank order."""
    from tests.engine.conftest import hf_state_dict

    with LLM(
        str(checkpoints[0]),
        tensor_parallel_size=2,
        worker_extension_cls="tests.engine.worker_extensions.RefitExtension",
        **OPTIONS,
    ) as llm:
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        assert llm.collective_rpc("refit_from_state_dict", args=(hf_state_dict(2),)) == [0, 1]
        llm.wake_up(["kv_cache"])
        assert tokens(llm) == expected["greedy_b"]
        assert llm.collective_rpc(lambda worker: worker.rank * 10) == [0, 10]
