"""``sleep(level, release_context=True)`` on a CPU engine, against the fake libcuda
(tests/fake_driver.py): the driver is driven in order (lock, checkpoint; at wake restore,
unlock), calls that need the device refuse while released, defensive repeats are no-ops, tokens
after the RL cycle equal those before; and every refusal (level 0, tensor parallelism, an NCCL
group, a driver without the API) comes before anything changes. The GPU's own measurements are
tests/gpu/test_residual_release.py."""

from __future__ import annotations

import os

import pytest
import torch

from dormant import SamplingParams
from dormant.engine import EngineAsleepError
from dormant.engine.sleep_control import check_release_context
from dormant.memory import (
    CheckpointUnsupportedError,
    CommunicatorActiveError,
    ContextReleasedError,
)
from tests.engine.conftest import GREEDY, PROMPTS, tokens, worker_of
from tests.fake_driver import FakeDriver

SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def device() -> str:
    return "cpu"  # the host backend (make_llm's device); the fake driver stands in for CUDA's


def test_an_rl_cycle_with_the_context_released(make_llm, checkpoint, fake_driver) -> None:
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    before = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.sleep(level=2, release_context=True)
    pid = os.getpid()
    assert fake_driver.calls()[:2] == [f"lock {pid} 30000", f"checkpoint {pid}"]
    (status,) = llm.memory_status()
    assert status.context is not None and status.context.is_released
    with pytest.raises(EngineAsleepError):
        llm.generate(PROMPTS, SHORT, use_tqdm=False)
    with pytest.raises(ContextReleasedError, match="wake_up"):
        worker_of(llm).mm.empty((4,), torch.float32, "workspace")
    llm.sleep(level=2, release_context=True)  # defensive repeats change nothing
    llm.sleep(level=2)
    assert fake_driver.ops() == ["lock", "checkpoint"]
    llm.wake_up(["weights"])  # restores first
    assert fake_driver.ops() == ["lock", "checkpoint", "restore", "unlock"]
    llm.collective_rpc("reload_weights")
    assert llm.wake_up(["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == before
    (status,) = llm.memory_status()
    assert status.context is not None and not status.context.is_released
    assert status.context.restore_s is not None


def test_a_released_engine_restores_before_it_shuts_down(make_llm, checkpoint, fake_driver) -> None:
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    llm.sleep(level=1, release_context=True)
    llm.shutdown()
    assert fake_driver.ops() == ["lock", "checkpoint", "restore", "unlock"]


def test_level_0_is_refused(make_llm, checkpoint, fake_driver: FakeDriver) -> None:
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    with pytest.raises(ValueError, match="level 0 only pauses"):
        llm.sleep(level=0, release_context=True)
    assert not llm.is_sleeping() and fake_driver.calls() == []


def test_a_driver_without_the_api_is_refused_before_anything(make_llm, checkpoint, old_driver):
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    engine = llm.llm_engine
    engine.add_request(PROMPTS[0], SHORT)
    with pytest.raises(CheckpointUnsupportedError, match="driver 570"):
        llm.sleep(level=2, release_context=True)
    assert not llm.is_sleeping()
    assert engine.has_unfinished_requests()  # the in-flight request was not aborted either
    engine.abort_request()


def test_an_nccl_group_is_refused(make_llm, checkpoint, fake_driver, monkeypatch) -> None:
    import dormant.memory.context_release as context_release

    monkeypatch.setattr(context_release, "nccl_groups", lambda: ["weight_update_group"])
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    with pytest.raises(CommunicatorActiveError, match="weight_update_group"):
        llm.sleep(level=2, release_context=True)
    assert not llm.is_sleeping() and fake_driver.calls() == []


def test_tensor_parallelism_is_refused() -> None:
    with pytest.raises(CommunicatorActiveError, match="tensor_parallel_size=2"):
        check_release_context(2, tensor_parallel_size=2)
    check_release_context(2, tensor_parallel_size=1)


def test_an_mps_client_is_refused_before_anything(make_llm, checkpoint, fake_driver, monkeypatch):
    """Under MPS the driver cannot checkpoint the engine's process: refused with the reason, the
    engine awake and its in-flight request kept (on an H100 the lock failed only once the tags
    slept, 2026-12-06c run 8)."""
    from dormant.memory import nvml

    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    engine = llm.llm_engine
    monkeypatch.setattr(worker_of(llm).mm.residual, "_pci_bus_id", "00000000:06:00.0")
    monkeypatch.setattr(nvml, "mps_clients", lambda bus: {os.getpid(): None})
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/a-pipe")  # as a client's
    engine.add_request(PROMPTS[0], SHORT)
    with pytest.raises(CheckpointUnsupportedError, match="MPS"):
        llm.sleep(level=2, release_context=True)
    assert not llm.is_sleeping() and fake_driver.calls() == []
    assert engine.has_unfinished_requests()
    llm.sleep(level=2)  # without release_context it sleeps as ever
    assert llm.wake_up()
