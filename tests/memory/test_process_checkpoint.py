"""The zero-residual mode's memory side on the CPU: the checkpoint helper against a fake libcuda
(the driver's state machine, its failures, a driver that hangs or dies), the refusals (no driver
support, NCCL communicators), and a manager whose context is released: calls that need the device
raise instead of blocking, frees wait for the restore, wake restores first."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest
import torch

from dormant.memory import (
    CheckpointFailedError,
    CheckpointTimeoutError,
    CheckpointUnsupportedError,
    CommunicatorActiveError,
    ContextReleasedError,
    MemoryManager,
    ProcessCheckpoint,
    ProcessState,
)
from dormant.memory import process_checkpoint as pc
from tests.fake_driver import FakeDriver

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkpoint() -> ProcessCheckpoint:
    made = ProcessCheckpoint(lock_timeout_s=2.0, reply_timeout_s=20.0)
    yield made
    made.close()


def test_a_cycle_drives_the_driver_in_order(fake_driver: FakeDriver, checkpoint) -> None:
    assert checkpoint.probe() is ProcessState.RUNNING
    assert checkpoint.driver_version == 12080
    checkpoint.checkpoint()
    assert checkpoint.state() is ProcessState.CHECKPOINTED
    checkpoint.restore()
    assert checkpoint.state() is ProcessState.RUNNING
    pid = os.getpid()
    # the lock's timeout reaches the driver in its args struct; every call names this process
    assert fake_driver.calls() == [
        f"lock {pid} 2000", f"checkpoint {pid}", f"restore {pid}", f"unlock {pid}"
    ]  # fmt: skip


def test_a_driver_without_the_api_is_refused(old_driver: None, checkpoint) -> None:
    with pytest.raises(CheckpointUnsupportedError, match="570"):
        checkpoint.probe()


def test_an_old_driver_version_is_refused(fake_driver: FakeDriver, checkpoint) -> None:
    fake_driver.set(version="12040")
    with pytest.raises(CheckpointUnsupportedError, match="12040"):
        checkpoint.probe()
    assert fake_driver.calls() == []


def test_no_libcuda_is_refused(tmp_path, monkeypatch: pytest.MonkeyPatch, checkpoint) -> None:
    import ctypes.util

    if ctypes.util.find_library("cuda") is not None:
        pytest.skip("this machine has a real libcuda")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    with pytest.raises(CheckpointUnsupportedError, match=r"libcuda\.so\.1"):
        checkpoint.probe()


def test_a_lock_that_times_out_leaves_the_process_running(fake_driver, checkpoint) -> None:
    fake_driver.set(fail="lock")
    with pytest.raises(CheckpointFailedError, match="CUDA_ERROR_TIMEOUT") as raised:
        checkpoint.checkpoint()
    assert raised.value.state is ProcessState.RUNNING
    assert fake_driver.ops() == ["lock"]


def test_a_failed_checkpoint_unlocks_again(fake_driver: FakeDriver, checkpoint) -> None:
    fake_driver.set(fail="checkpoint")
    with pytest.raises(CheckpointFailedError, match="cuCheckpointProcessCheckpoint") as raised:
        checkpoint.checkpoint()
    assert raised.value.state is ProcessState.RUNNING
    assert fake_driver.ops() == ["lock", "checkpoint", "unlock"]
    assert checkpoint.state() is ProcessState.RUNNING


def test_a_driver_that_never_answers_is_an_error_not_a_hang(fake_driver: FakeDriver) -> None:
    fake_driver.set(hang="checkpoint")
    checkpoint = ProcessCheckpoint(lock_timeout_s=1.0, reply_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(CheckpointTimeoutError, match="no answer"):
        checkpoint.checkpoint()
    assert time.monotonic() - start < 20
    assert checkpoint._helper is None  # killed
    checkpoint.close()


def test_a_helper_that_dies_is_an_error(fake_driver: FakeDriver, checkpoint) -> None:
    fake_driver.set(exit="lock")
    with pytest.raises(CheckpointFailedError, match="helper died"):
        checkpoint.checkpoint()
    fake_driver.set(exit="")
    assert checkpoint.probe() is ProcessState.RUNNING  # a new helper starts


def test_nccl_communicators_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import distributed_c10d as c10d

    group, other = object(), object()
    world = type("World", (), {})()
    world.pg_map = {group: ("nccl", None), other: ("gloo", None)}
    world.pg_names = {group: "weight_update_group", other: "cpu_group"}
    monkeypatch.setattr(c10d, "_world", world)
    assert pc.nccl_groups() == ["weight_update_group"]


def test_a_manager_with_an_nccl_communicator_refuses(fake_driver, monkeypatch) -> None:
    monkeypatch.setattr(pc, "nccl_groups", lambda: ["tp"])
    import dormant.memory.context_release as context_release

    monkeypatch.setattr(context_release, "nccl_groups", lambda: ["tp"])
    mm = MemoryManager("host")
    try:
        with pytest.raises(CommunicatorActiveError, match="tp"):
            mm.context.release()
        assert not mm.context.is_released and fake_driver.calls() == []
    finally:
        mm.close()


def test_a_released_manager_refuses_the_device_and_defers_frees(fake_driver) -> None:
    mm = MemoryManager("host")
    try:
        kept = mm.empty((4 * MiB,), torch.uint8, "weights")
        kept.fill_(7)
        doomed = mm.empty((4 * MiB,), torch.uint8, "runtime")
        mm.sleep(level=1)
        report = mm.context.release()
        assert report.is_released and mm.context.is_released
        assert mm.context.release() is report  # a second release is a no-op
        with pytest.raises(ContextReleasedError, match="wake_up"):
            mm.empty((16,), torch.uint8, "workspace")
        with pytest.raises(ContextReleasedError):
            mm.sleep(level=1)
        assert not gc.isenabled()  # no collection can free a tensor into the locked driver
        status = mm.status()  # answers without the device
        assert status.context is not None and status.context.is_released
        assert "released" in status.table()
        del doomed
        gc.collect()
        backend = mm.backend
        # the free waits for the restore: its VA is still reserved
        assert len(backend.live_reservations()) == 2  # type: ignore[attr-defined]
        mm.wake_up()
        assert not mm.context.is_released and gc.isenabled()
        assert len(backend.live_reservations()) == 1  # type: ignore[attr-defined]
        assert bool((kept == 7).all())
        assert fake_driver.ops() == ["lock", "checkpoint", "restore", "unlock"]
        restored = mm.status().context
        assert restored is not None and restored.restore_s is not None
    finally:
        mm.close()


def test_closing_a_released_manager_restores_first(fake_driver) -> None:
    mm = MemoryManager("host")
    tensor = mm.empty((MiB,), torch.uint8, "weights")
    mm.context.release()
    mm.close()
    assert fake_driver.ops() == ["lock", "checkpoint", "restore", "unlock"]
    del tensor


def test_a_process_that_exits_released_is_restored_first(fake_driver: FakeDriver) -> None:
    import subprocess
    import sys

    script = (
        "import torch; from dormant.memory import MemoryManager; mm = MemoryManager('host'); "
        "t = mm.empty((1 << 20,), torch.uint8, 'weights'); mm.context.release()"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=120, cwd=ROOT)
    assert done.returncode == 0
    assert fake_driver.ops() == ["lock", "checkpoint", "restore", "unlock"]


def test_a_released_process_reads_nvml_only_through_the_helper(fake_driver, monkeypatch) -> None:
    """A process whose CUDA state is locked blocks in its own NVML calls (an H200, driver 580:
    ``sleep(level=2, release_context=True)`` hung reading NVML right after the checkpoint).
    While released, the figures come from the helper: the report's and status()'s."""
    from dormant.memory import nvml

    mm = MemoryManager("host")
    pid = os.getpid()
    fake_driver.set_nvml(pid, process_bytes=0, used_bytes=3 * MiB)  # the GPU shows nothing

    def own_reading(bus: str) -> dict[int, int]:  # what this process's NVML would answer
        assert not mm.context.is_released, "the locked process read NVML itself"
        return {pid: 900 * MiB}

    monkeypatch.setattr(nvml, "compute_processes", own_reading)
    monkeypatch.setattr(nvml, "device_memory", lambda bus: own_reading(bus) and None)
    monkeypatch.setattr(mm.residual, "_pci_bus_id", "00000000:06:00.0")  # a CUDA manager's
    monkeypatch.setattr(mm.residual, "_is_listed", True)
    try:
        tensor = mm.empty((MiB,), torch.uint8, "weights")
        mm.sleep(level=2)
        report = mm.context.release()
        assert (report.process_bytes_before, report.process_bytes_released) == (900 * MiB, 0)
        status = mm.status()
        assert (status.device_used_bytes, status.device_total_bytes) == (3 * MiB, 141 * 10**9)
        checkpointed = [r for r in status.residual if r.owner.startswith("this process")]
        assert [r.nbytes for r in checkpointed] == [0]
        assert set(fake_driver.nvml_readers()) == {checkpoint_helper_pid(fake_driver)}
        mm.wake_up()
        restored = mm.status().context
        assert restored is not None and restored.process_bytes_restored == 900 * MiB
    finally:
        mm.close()
    del tensor


def checkpoint_helper_pid(fake_driver: FakeDriver) -> int:
    """The helper's pid: the one the fake NVML saw that is not this process (it must be)."""
    readers = set(fake_driver.nvml_readers()) - {os.getpid()}
    assert len(readers) == 1, fake_driver.lines()
    return readers.pop()


def test_memory_is_unknown_without_nvml_or_a_helper(tmp_path, monkeypatch, checkpoint) -> None:
    """The helper answers what NVML cannot say with nulls, and a helper that cannot answer
    makes the reading unknown: never an error (a status while released must not fail)."""
    import ctypes.util

    from dormant.memory import nvml

    if ctypes.util.find_library("nvidia-ml") is not None:
        pytest.skip("this machine has a real libnvidia-ml")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))  # no libcuda, no NVML
    assert checkpoint.memory("00000000:06:00.0") == nvml.UNKNOWN
    monkeypatch.setattr(pc, "HELPER", tmp_path / "missing_helper.py")  # it dies at once
    checkpoint.close()
    assert checkpoint.memory("00000000:06:00.0") == nvml.UNKNOWN


def test_nvml_lists_mps_clients(fake_libraries, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML's list of MPS clients, read through the fake: the client's pid, its memory not
    available; an empty list without one (and the compute list keeps leaving out a process
    whose figure NVML withholds)."""
    import ctypes

    from dormant.memory import nvml

    monkeypatch.setattr(
        nvml, "_library", [ctypes.CDLL(str(fake_libraries[0] / "libnvidia-ml.so.1"))]
    )
    monkeypatch.delenv("FAKE_NVML_MPS_CLIENT", raising=False)
    monkeypatch.delenv("FAKE_NVML_PROCESS", raising=False)
    assert nvml.mps_clients("00000000:06:00.0") == {}
    monkeypatch.setenv("FAKE_NVML_MPS_CLIENT", "4242")
    monkeypatch.setenv("FAKE_NVML_PROCESS", "17:1048576")
    assert nvml.mps_clients("00000000:06:00.0") == {4242: None}
    assert nvml.compute_processes("00000000:06:00.0") == {17: MiB}


def test_an_mps_client_is_refused_before_anything_changes(fake_driver, monkeypatch) -> None:
    """The driver cannot checkpoint an MPS client (its lock answered CUDA_ERROR_NOT_SUPPORTED on
    an H100, driver 580, after the tags had slept): NVML's list of them refuses it first."""
    from dormant.memory import nvml

    mm = MemoryManager("host")
    monkeypatch.setattr(mm.residual, "_pci_bus_id", "00000000:06:00.0")  # a CUDA manager's
    monkeypatch.setattr(nvml, "mps_clients", lambda bus: {os.getpid(): None})
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/a-pipe")  # as a client's
    try:
        tensor = mm.empty((MiB,), torch.uint8, "weights")
        for call in (mm.context.check, mm.context.release):
            with pytest.raises(CheckpointUnsupportedError, match="MPS"):
                call()
        assert not mm.context.is_released and fake_driver.calls() == []
        monkeypatch.setattr(nvml, "mps_clients", lambda bus: {os.getpid() + 1: None})
        mm.context.check()  # another process's client: this one can be checkpointed
    finally:
        mm.close()
    del tensor


def test_a_listed_pid_is_not_this_process_where_no_mps_pipe_is_reachable(
    fake_driver, monkeypatch, tmp_path
) -> None:
    """Behind a PID namespace, NVML's client pids are the host's: one can equal this process's
    pid. A process that reaches no MPS pipe folder cannot be a client, so it is not refused."""
    from dormant.memory import context_release, nvml

    mm = MemoryManager("host")
    monkeypatch.setattr(mm.residual, "_pci_bus_id", "00000000:06:00.0")
    monkeypatch.setattr(nvml, "mps_clients", lambda bus: {os.getpid(): None})
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(context_release, "MPS_DEFAULT_PIPE", str(tmp_path / "none"))
    try:
        mm.context.check()  # not refused: the driver's checkpoint is probed instead
        (tmp_path / "none").mkdir()  # the default pipe folder: a client may use it
        with pytest.raises(CheckpointUnsupportedError, match="MPS"):
            mm.context.check()
    finally:
        mm.close()
