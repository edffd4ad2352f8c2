"""``LocalMemory``: the stack limit goes to 0 at release and back to what it was at restore, once
each; off CUDA nothing happens. The driver and torch's device calls are stand-ins here; the GPU
test (tests/gpu/test_local_memory_gpu.py) runs the real ones."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from dormant.memory import local_memory
from dormant.memory.errors import DriverError
from dormant.memory.local_memory import LocalMemory

MiB = 1 << 20


class FakeContext:
    """The driver's stack limit, and a reservation that is its size times 1 MiB."""

    def __init__(self, limit: int) -> None:
        self.limit, self.calls = limit, []

    def get(self) -> int:
        return self.limit

    def set(self, nbytes: int) -> None:
        self.calls.append(nbytes)
        self.limit = nbytes

    def mem_get_info(self) -> tuple[int, int]:
        return 1000 * MiB - self.limit * MiB, 1000 * MiB


@contextlib.contextmanager
def on_a_fake_gpu(context: FakeContext):
    with (
        mock.patch.object(local_memory, "_stack_limit", context.get),
        mock.patch.object(local_memory, "_set_stack_limit", context.set),
        mock.patch.object(torch.cuda, "is_initialized", lambda: True),
        mock.patch.object(torch.cuda, "device", lambda device: contextlib.nullcontext()),
        mock.patch.object(torch.cuda, "synchronize", lambda *a: None),
        mock.patch.object(torch.cuda, "mem_get_info", context.mem_get_info),
    ):
        yield


def test_release_then_restore_sets_the_limit_to_zero_and_back() -> None:
    context = FakeContext(limit=24)
    memory = LocalMemory(torch.device("cuda", 0))
    with on_a_fake_gpu(context):
        release = memory.release()
        assert release is not None and memory.is_released
        assert (release.stack_limit_bytes, release.freed_bytes) == (24, 24 * MiB)
        assert memory.release() is None  # already released: nothing changes
        memory.restore()
        assert not memory.is_released and context.limit == 24
        memory.restore()  # not released: nothing to restore
    assert context.calls == [0, 24]
    assert memory.last_release == release  # reported until the next sleep


def test_a_driver_refusal_is_logged_and_changes_nothing(caplog) -> None:
    context = FakeContext(limit=24)

    def refuse(nbytes: int) -> None:
        raise DriverError("cuCtxSetLimit failed: CUDA_ERROR_INVALID_VALUE")

    memory = LocalMemory(torch.device("cuda", 0))
    with on_a_fake_gpu(context), mock.patch.object(local_memory, "_set_stack_limit", refuse):
        assert memory.release() is None
    assert not memory.is_released and memory.last_release is None
    assert "stays reserved" in caplog.text
    with on_a_fake_gpu(context):
        memory.release()
    with on_a_fake_gpu(context), mock.patch.object(local_memory, "_set_stack_limit", refuse):
        memory.restore()  # logged; the next sleep may release again
    assert not memory.is_released and "could not be set again" in caplog.text


def test_nothing_happens_off_cuda() -> None:
    memory = LocalMemory(torch.device("cpu"))
    with mock.patch.object(local_memory, "_set_stack_limit") as set_limit:
        assert memory.release() is None
        memory.restore()
    set_limit.assert_not_called()
    assert not memory.is_released and memory.last_release is None
