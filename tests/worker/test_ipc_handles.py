"""The receiver's own map of opened IPC storages (``dormant/worker/ipc_handles.py``) on the CPU:
rebuild arguments as torch's ``reduce_tensor`` gives them, a faked driver (``FakeDriver``: a
NumPy buffer per handle, a real ref-counter file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from dormant.worker.ipc_handles import IpcHandles
from dormant.worker.transfer_errors import WeightTransferError
from tests.worker.test_ipc_receiver import COUNTERS, FakeDriver

NBYTES = 4096


@pytest.fixture
def driver(tmp_path: Path) -> FakeDriver:
    d = FakeDriver(tmp_path)
    for handle in (b"a", b"b"):
        d.buffers[handle] = np.arange(NBYTES, dtype=np.uint8)
    return d


def args(driver: FakeDriver, handle: bytes = b"a", **changes: Any) -> tuple[Any, ...]:
    """torch's 15 rebuild arguments for 64 bf16 values at element 8 of ``handle``'s storage."""
    values = dict(
        cls=Tensor, size=torch.Size([64]), stride=(1,), offset=8, storage_cls=torch.UntypedStorage,
        dtype=torch.bfloat16, device=0, handle=handle, nbytes=NBYTES, storage_offset=0,
        requires_grad=False, counter=COUNTERS, slot=driver.share(),
        event=b"e%d" % driver.num_shared, sync=True,
    )  # fmt: skip
    values.update(changes)
    return tuple(values.values())


def expected(driver: FakeDriver, handle: bytes, offset: int = 8, n: int = 64) -> Tensor:
    flat = torch.from_numpy(driver.buffers[handle]).view(torch.bfloat16)
    return flat[offset : offset + n]


def test_a_miss_opens_a_hit_views_releases_its_counter_and_waits(driver: FakeDriver) -> None:
    handles = driver.handles()
    first = handles.rebuild_cuda_tensor(*args(driver))
    assert handles.num_opened == 1 and driver.kept == [0] and driver.waits == []
    second_args = args(driver, offset=16, size=torch.Size([4, 8]), stride=(8, 1))
    second = handles.rebuild_cuda_tensor(*second_args)  # the same storage: held
    assert handles.num_opened == 1 and handles.num_reused == 1
    assert driver.slots[1] == 0 and driver.slots[0] == 1  # released once / kept by the open
    assert driver.waits == [(0, b"e2")]
    assert torch.equal(first, expected(driver, b"a"))
    assert torch.equal(second, expected(driver, b"a", 16, 32).view(4, 8))
    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    unsynced = handles.rebuild_cuda_tensor(*args(driver, sync=False))
    assert driver.waits == [(0, b"e2")] and driver.slots[2] == 0  # no event to wait on
    assert torch.equal(unsynced, first)


def test_held_storages_last_one_payload_and_a_new_handle_evicts_the_old(
    driver: FakeDriver,
) -> None:
    handles = driver.handles()
    held = handles.rebuild_cuda_tensor(*args(driver, b"a"))
    handles.end_payload()
    assert handles.num_held == 1
    del held  # the receiver's hold alone keeps it open
    assert driver.is_open(b"a")
    handles.rebuild_cuda_tensor(*args(driver, b"a"))  # the next payload reuses it
    handles.end_payload()
    assert handles.num_opened == 1 and handles.num_reused == 1 and driver.is_open(b"a")
    handles.rebuild_cuda_tensor(*args(driver, b"b"))  # the sender sent a new handle
    assert driver.is_open(b"a")  # until this payload was copied
    handles.end_payload()
    assert not driver.is_open(b"a") and driver.is_open(b"b") and handles.num_held == 1
    handles.release()
    assert not driver.is_open(b"b") and handles.num_held == 0 and handles.counters.num_open == 0
    assert handles.num_opened == 2 and driver.kept == [0, 2]


def test_a_held_handle_of_another_size_or_device_is_opened_again(driver: FakeDriver) -> None:
    handles = driver.handles()
    handles.rebuild_cuda_tensor(*args(driver))
    driver.buffers[b"a"] = np.zeros(2 * NBYTES, dtype=np.uint8)
    handles.rebuild_cuda_tensor(*args(driver, nbytes=2 * NBYTES))
    assert handles.num_opened == 2 and handles.num_reused == 0


def test_one_entry_per_share_releases_one_counter_each_within_a_payload(
    driver: FakeDriver,
) -> None:
    """Two tensors of one storage in one payload (named tensors, the trainer's own weights):
    one open, and the second share's counter released at once."""
    handles = driver.handles()
    tensors = [handles.rebuild_cuda_tensor(*args(driver, offset=o)) for o in (0, 64, 128)]
    assert handles.num_opened == 1 and handles.num_reused == 2
    assert driver.slots[:3].tolist() == [1, 0, 0] and handles.counters.num_released == 2
    assert [t.data_ptr() - tensors[0].data_ptr() for t in tensors] == [0, 128, 256]


def test_a_parameter_and_requires_grad_are_kept(driver: FakeDriver) -> None:
    handles = driver.handles()
    as_float = dict(dtype=torch.float32, size=torch.Size([8]), offset=0)
    param = handles.rebuild_cuda_tensor(
        *args(driver, cls=torch.nn.Parameter, requires_grad=True, **as_float)
    )
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    plain = handles.rebuild_cuda_tensor(*args(driver, requires_grad=True, **as_float))
    assert type(plain) is Tensor and plain.requires_grad and handles.num_reused == 1


@pytest.mark.parametrize(
    "bad",
    [
        dict(handle="a"), dict(nbytes=-1), dict(storage_offset=-8), dict(device="0"),
        dict(counter="/torch"), dict(slot=None), dict(event=None), dict(dtype="bfloat16"),
        dict(cls=np.ndarray),
    ],
)  # fmt: skip
def test_malformed_arguments_raise_a_typed_error_and_change_nothing(
    driver: FakeDriver, bad: dict[str, Any]
) -> None:
    handles = driver.handles()
    handles.rebuild_cuda_tensor(*args(driver))
    handles.end_payload()
    malformed = args(driver, **bad)
    before = driver.slots.copy()
    with pytest.raises(WeightTransferError, match="malformed"):
        handles.rebuild_cuda_tensor(*malformed)
    assert (driver.slots == before).all() and driver.waits == []
    assert handles.num_held == 1 and handles.num_opened == 1 and handles.num_reused == 0
    handles.end_payload()  # nothing of the failed rebuild was kept for this payload
    assert handles.num_held == 0


def test_a_view_outside_the_held_storage_raises_and_still_releases_its_counter(
    driver: FakeDriver,
) -> None:
    """As torch's own cache hit does: an unreleased share's counter would keep the sender's
    block waiting for this receiver for good. Its event is waited on first (once the counter
    is released, the sender may drop the event)."""
    handles = driver.handles()
    handles.rebuild_cuda_tensor(*args(driver))
    with pytest.raises(RuntimeError, match="out of bounds"):
        handles.rebuild_cuda_tensor(*args(driver, size=torch.Size([NBYTES])))
    assert driver.slots[1] == 0 and driver.waits == [(0, b"e2")] and handles.num_reused == 0


def test_an_empty_storage_or_another_torchs_arguments_go_to_torch(driver: FakeDriver) -> None:
    calls: list[int] = []
    handles = IpcHandles(driver.open_storage, rebuild=lambda *a: calls.append(len(a)))
    handles.rebuild_cuda_tensor(*args(driver, handle=None))
    handles.rebuild_cuda_tensor(*args(driver, nbytes=0))
    handles.rebuild_cuda_tensor(*args(driver)[:14])
    assert calls == [15, 15, 14] and handles.num_opened == 0
