"""The SM copy path on a real GPU (issue 17): kernels that read and write pinned host memory
through its device mapping are bit-exact at odd sizes and offsets, in both directions, through
the backend's batches; and a wake right after a large release takes the SM path (forced copy
engines take the other), restoring every byte."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dormant.memory import CopyMode, CopyPath, CopyPathPolicy, MemoryManager, Policy, libc
from dormant.memory.backend import Copy
from dormant.memory.dlpack import tensor_at
from dormant.memory.path_copies import PathCopies
from dormant.memory.sm_copy import sm_copy

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30
HOST_BYTES = 96 * MiB
SIZES = [1, 7, 16, 4099, 2 * MiB + 3, 64 * MiB + 1]
OFFSETS = [(0, 0), (3, 3), (1, 2), (5, 13)]


@pytest.fixture
def mm() -> Iterator[MemoryManager]:
    manager = MemoryManager("cuda")
    yield manager
    manager.close()


@pytest.fixture
def pinned(mm: MemoryManager) -> Iterator[torch.Tensor]:
    """HOST_BYTES of host memory pinned the way the arena pins it, as a CPU uint8 tensor."""
    address = libc.map_anonymous(HOST_BYTES)
    libc.populate(address, HOST_BYTES)
    mm.backend.pin(address, HOST_BYTES)
    view = tensor_at(address, HOST_BYTES, torch.device("cpu"), lambda: None)
    yield view
    del view
    mm.backend.unpin(address, HOST_BYTES)
    libc.munmap(address, HOST_BYTES)


def device_address(mm: MemoryManager, host: int) -> int:
    return mm.backend.host_mappings.device_address(host)  # type: ignore[attr-defined]


@pytest.mark.parametrize("dst_offset,src_offset", OFFSETS)
def test_sm_copy_is_bit_exact_both_ways(
    mm: MemoryManager, pinned: torch.Tensor, dst_offset: int, src_offset: int
) -> None:
    device = torch.empty(HOST_BYTES, dtype=torch.uint8, device="cuda")
    noise = torch.randint(0, 256, (HOST_BYTES,), dtype=torch.uint8)
    for nbytes in SIZES:
        pinned.copy_(noise.roll(nbytes))
        device.fill_(0)
        host_src = device_address(mm, pinned.data_ptr() + src_offset)
        sm_copy(device.data_ptr() + dst_offset, host_src, nbytes, device.device)
        torch.cuda.synchronize()
        got = device[dst_offset : dst_offset + nbytes].cpu()
        assert torch.equal(got, pinned[src_offset : src_offset + nbytes]), nbytes
        assert not device[:dst_offset].any() and not device[dst_offset + nbytes :].any()

        expected = noise[-nbytes:].clone()
        device[src_offset : src_offset + nbytes].copy_(expected.cuda())
        pinned.fill_(0)
        host_dst = device_address(mm, pinned.data_ptr() + dst_offset)
        sm_copy(host_dst, device.data_ptr() + src_offset, nbytes, device.device)
        torch.cuda.synchronize()
        assert torch.equal(pinned[dst_offset : dst_offset + nbytes], expected), nbytes
        assert not pinned[:dst_offset].any() and not pinned[dst_offset + nbytes :].any()


@pytest.mark.parametrize("path", list(CopyPath))
def test_every_path_batch_is_bit_exact(
    mm: MemoryManager, pinned: torch.Tensor, path: CopyPath
) -> None:
    """Host-to-device copies through the backend (host addresses, as the wake passes them)."""
    pinned.copy_(torch.randint(0, 256, (HOST_BYTES,), dtype=torch.uint8))
    device = torch.zeros(HOST_BYTES, dtype=torch.uint8, device="cuda")
    pieces = [(0, 0, 40 * MiB), (40 * MiB + 1, 40 * MiB + 3, 8 * MiB + 5), (90 * MiB, 90 * MiB, 7)]
    batch = PathCopies(mm.backend, path, 0.5)
    for dst, src, nbytes in pieces:
        batch.add(Copy(device.data_ptr() + dst, pinned.data_ptr() + src, nbytes))
    batch.wait(0)
    batch.wait_all()
    for dst, src, nbytes in pieces:
        assert torch.equal(device[dst : dst + nbytes].cpu(), pinned[src : src + nbytes])
    assert sum(batch.bytes_by_path.values()) == sum(n for _, _, n in pieces)
    assert (batch.bytes_by_path[CopyPath.SM] > 0) is (path is not CopyPath.COPY_ENGINE)


@pytest.mark.parametrize(
    "mode,expected", [(CopyMode.AUTO, CopyPath.SM), (CopyMode.COPY_ENGINE, CopyPath.COPY_ENGINE)]
)
def test_a_wake_right_after_a_large_release_takes_the_policys_path(
    mm: MemoryManager, mode: CopyMode, expected: CopyPath
) -> None:
    """4 GiB of KV released, then the weights' wake at once: AUTO (its threshold at 2 GiB here)
    takes the SM path, a forced copy-engine mode the copy engines; both bit-exact."""
    mm.copy_policy = CopyPathPolicy(mode=mode, min_release_bytes=2 * GiB)
    weights = [mm.empty((n,), torch.uint8, "weights") for n in (256 * MiB, 3 * MiB + 5, 4097)]
    expected_bytes = [torch.randint(0, 256, (t.numel(),), dtype=torch.uint8) for t in weights]
    for tensor, values in zip(weights, expected_bytes, strict=True):
        tensor.copy_(values.cuda())
    kv = mm.empty((4 * GiB,), torch.uint8, "kv_cache")
    kv.view(-1)[:: 64 * MiB].fill_(1)
    for _ in range(2):  # the second cycle skips the unchanged copies but wakes the same way
        mm.sleep(tags={"weights": Policy.HOST, "kv_cache": Policy.DISCARD})
        report = mm.wake_up(["weights"])
        assert report.copy_path is expected
        assert report.recent_release_bytes >= 4 * GiB
        by_path = report.bytes_sm if expected is CopyPath.SM else report.bytes_copy_engine
        assert by_path == report.bytes_copied > 256 * MiB
        for tensor, values in zip(weights, expected_bytes, strict=True):
            assert torch.equal(tensor.cpu(), values)
        mm.wake_up()
    del kv, weights
