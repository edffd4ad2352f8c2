"""When a sleep releases its DISCARD memory against its HOST copies (offload.DiscardOrder), and
how many backend calls a KV discard and restore make: each order's place in the sequence of
backend calls, the contents after wake, and the truth after a failed release."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from dormant.memory import (
    CopyPath,
    DiscardOrder,
    DriverError,
    MemoryManager,
    Policy,
    SleepFailedError,
    State,
    UnknownDiscardOrderError,
)
from tests.memory.faults import FaultyBackend, check_truth
from tests.memory.helpers import random_fill, same_bytes

MiB = 1 << 20
KV = 16 * MiB
LEVEL1 = {"weights": "host", "kv_cache": "discard"}


class OrderBackend(FaultyBackend):
    """Records (event, bytes, thread) for copies started and landed, unmaps and releases; the
    release of a ``fail_size`` allocation raises once."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int, int]] = []
        self.sizes: dict[int, int] = {}  # handle -> bytes
        self.fail_size: int | None = None

    def _record(self, kind: str, nbytes: int) -> None:
        self.events.append((kind, nbytes, threading.get_ident()))

    def create(self, size: int) -> int:
        handle = int(self.inner.create(size))
        self.sizes[handle] = size
        return handle

    def unmap(self, va: int, size: int) -> None:
        self._record("unmap", size)
        self.inner.unmap(va, size)

    def release(self, handle: int) -> None:
        size = self.sizes[handle]
        if size == self.fail_size:
            self.fail_size = None
            raise DriverError("cuMemRelease failed: injected")
        self._record("release", size)
        self.inner.release(handle)

    def copy_batch(self, path=CopyPath.COPY_ENGINE):  # type: ignore[no-untyped-def]
        inner, record, sizes = self.inner.copy_batch(path), self._record, []

        class Copies:
            def add(self, copy):  # type: ignore[no-untyped-def]
                record("copy", copy.nbytes)
                sizes.append(copy.nbytes)
                return inner.add(copy)

            def wait(self, index):  # type: ignore[no-untyped-def]
                inner.wait(index)
                record("landed", sizes[index])

            def wait_all(self):  # type: ignore[no-untyped-def]
                inner.wait_all()

        return Copies()

    def at(self, kind: str, nbytes: int) -> int:
        return next(i for i, (k, n, _) in enumerate(self.events) if (k, n) == (kind, nbytes))

    def span(self, kind: str) -> tuple[int, int]:
        """The first and last index of ``kind``."""
        found = [i for i, (k, _, _) in enumerate(self.events) if k == kind]
        return found[0], found[-1]


@pytest.fixture
def backend() -> OrderBackend:
    return OrderBackend()


@pytest.fixture
def mm(backend: OrderBackend) -> Iterator[MemoryManager]:
    manager = MemoryManager(backend, max_slab_bytes=2 * MiB, slab_rules={})  # a handle per tensor
    yield manager
    manager.close()


def _weights(mm: MemoryManager) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    tensors = [mm.empty((n * MiB,), torch.uint8, "weights") for n in (8, 4, 2)]
    return tensors, [random_fill(t, seed) for seed, t in enumerate(tensors)]


@pytest.mark.parametrize("order", list(DiscardOrder))
def test_each_order_releases_the_kv_cache_where_it_says(
    order: DiscardOrder, mm: MemoryManager, backend: OrderBackend
) -> None:
    tensors, expected = _weights(mm)
    kv = mm.empty((KV,), torch.uint8, "kv_cache")
    mm.discard_order = order.value  # its value is accepted too
    assert mm.discard_order is order
    report = mm.sleep(tags=LEVEL1)
    assert report.bytes_copied == 14 * MiB and report.discard_s > 0 and report.release_s > 0
    first_copy, last_copy = backend.span("copy")
    first_landed, last_landed = backend.span("landed")
    unmapped, released = backend.at("unmap", KV), backend.at("release", KV)
    if order is DiscardOrder.BEFORE_COPIES:
        assert released < first_copy
    elif order is DiscardOrder.UNMAP_FIRST:
        assert unmapped < first_copy and last_copy < released < first_landed
    elif order is DiscardOrder.UNDER_COPIES:  # while every copy is in flight, none landed
        assert last_copy < unmapped < released < first_landed
    elif order is DiscardOrder.AFTER_COPIES:
        assert released > last_landed
    else:  # THREAD: another thread's calls; the sleep returns once they are done
        assert backend.events[released][2] != threading.get_ident()
        assert backend.events[unmapped][2] == backend.events[released][2]
    assert [a.state for a in mm._table.allocations(["kv_cache"])] == [State.DISCARDED]
    check_truth(mm, backend)
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))
    del kv


def test_a_failed_release_in_the_discard_thread_is_raised_and_recorded(
    mm: MemoryManager, backend: OrderBackend
) -> None:
    """The sleep still copies and offloads the weights; the KV cache is left UNMAPPED (handle
    kept), the error says so, and repeating the sleep completes it."""
    tensors, expected = _weights(mm)
    kv = mm.empty((KV,), torch.uint8, "kv_cache")
    mm.discard_order = DiscardOrder.THREAD
    backend.fail_size = KV
    with pytest.raises(SleepFailedError) as failure:
        mm.sleep(tags=LEVEL1)
    assert "injected" in str(failure.value)
    (allocation,) = mm._table.allocations(["kv_cache"])
    assert allocation.state is State.UNMAPPED and allocation.handle is not None
    states = {a.state for a in mm._table.allocations(["weights"])}
    assert states == {State.OFFLOADED}
    check_truth(mm, backend)
    report = mm.sleep(tags=LEVEL1)  # retries the release only
    assert report.bytes_copied == 0 and allocation.state is State.DISCARDED
    check_truth(mm, backend)
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))
    del kv


def test_an_unknown_order_is_refused_and_changes_nothing(mm: MemoryManager) -> None:
    with pytest.raises(UnknownDiscardOrderError, match="'under copies'"):
        mm.discard_order = "sideways"
    assert mm.discard_order is DiscardOrder.UNDER_COPIES
    with pytest.raises(UnknownDiscardOrderError):
        MemoryManager("host", discard_order=3)  # type: ignore[arg-type]


def test_a_kv_discard_and_restore_make_only_the_calls_they_need() -> None:
    """Discard: synchronize, unmap, release. Restore: create, map. No copy batch is waited
    for (on CUDA each wait is a cuStreamSynchronize per stream) and nothing is hashed."""
    faulty = FaultyBackend()
    mm = MemoryManager(faulty)
    kv = mm.empty((KV,), torch.uint8, "kv_cache")
    for _ in range(2):
        faulty.arm()
        mm.sleep(tags={"kv_cache": "discard"})
        assert faulty.calls == {"synchronize": 1, "unmap": 1, "release": 1}
        faulty.arm()
        mm.wake_up(["kv_cache"])
        assert faulty.calls == {"create": 1, "map": 1}
    faulty.disarm()
    del kv
    mm.close()


class _Events:
    def get(self, index: int) -> str:
        return f"event {index}"


@pytest.mark.parametrize(
    ("sizes", "synchronized"),
    [([], []), ([MiB], ["s0"]), ([64 * MiB, 64 * MiB, MiB], ["s0", "s1"])],
)
def test_cuda_copies_synchronize_only_the_streams_they_used(
    monkeypatch: pytest.MonkeyPatch, sizes: list[int], synchronized: list[str]
) -> None:
    """The cuda backend's copy batch against a recording stand-in for the driver: an empty
    batch's wait_all makes no call; one group waits for its own stream only."""
    from dormant.memory import cuda_copies
    from dormant.memory.backend import Copy

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(cuda_copies, "call", lambda name, *args: calls.append((name, args[-1])))
    batch = cuda_copies.CudaCopies(["s0", "s1"], _Events())  # type: ignore[arg-type]
    for size in sizes:
        batch.add(Copy(0, 0, size))
    calls.clear()
    batch.wait_all()
    assert calls == [("cuStreamSynchronize", stream) for stream in synchronized]


@pytest.mark.parametrize("order", list(DiscardOrder))
def test_every_order_round_trips_on_each_backend(
    order: DiscardOrder, make_mm: Callable[..., MemoryManager]
) -> None:
    """On the cuda backend too: the THREAD order makes its driver calls from a second thread
    (the backend makes the primary context current there), the others from this one."""
    mm = make_mm(discard_order=order, max_slab_bytes=2 * MiB, slab_rules={})
    tensors, expected = _weights(mm)
    kv = mm.empty((KV,), torch.uint8, "kv_cache")
    for changed in (True, False):  # copied, then unchanged (released while later groups hash)
        if changed:
            tensors[0][0] ^= 1
            expected[0][0] ^= 1
        report = mm.sleep(tags=LEVEL1)
        assert report.bytes_copied == (14 * MiB if changed else 0)
        assert mm.asleep_tags == {"weights": Policy.HOST, "kv_cache": Policy.DISCARD}
        mm.wake_up()
        assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))
    del kv
