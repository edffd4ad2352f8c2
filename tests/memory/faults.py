"""Fault injection for the memory layer: a host backend whose k-th call of one method fails.

``FaultyBackend`` wraps a ``HostBackend``. Once armed with ``arm(method, k)``, it counts the calls
of every method in ``COUNTED`` and makes the k-th call of ``method`` raise ``DriverError`` before
doing anything (a failed driver call does not do its work), once. The copy batch's methods count
as ``"copy_batch.add"``, ``"copy_batch.wait"`` and ``"copy_batch.wait_all"``, the hash batch's as
``"hash_batch.add"`` and ``"hash_batch.wait"``. Counting is thread-safe: the arena pins from
background threads.

``check_truth(mm)`` compares what the manager says about every allocation (and what ``status()``
says about every tag) with what the host backend really has: live handles, mapped ranges and
reservations.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dormant.memory import DriverError, MemoryManager, State, TagState
from dormant.memory.backend import Copy, Span
from dormant.memory.copy_path import CopyPath
from dormant.memory.host_backend import HostBackend
from dormant.memory.tag_machine import tag_state

# Every backend call that sleep, wake and a free make (the host backend has no set-access).
COUNTED = (
    "synchronize",
    "hash_batch.add",
    "hash_batch.wait",
    "pin",
    "copy_batch.add",
    "copy_batch.wait",
    "copy_batch.wait_all",
    "unmap",
    "release",
    "create",
    "map",
    "fill",
    "free_reservation",
)


class FaultyBackend:
    """A HostBackend with an injectable failure; everything else is delegated unchanged."""

    def __init__(self, inner: HostBackend | None = None) -> None:
        self.inner = inner or HostBackend()
        self.calls: Counter[str] = Counter()
        self.phase = ""  # what the caller is doing (e.g. "sleep"), recorded with each call
        self.phases: dict[str, list[str]] = {}  # method -> the phase of each of its calls
        self.is_counting = False
        self.num_pinned = 0  # pins minus unpins that landed: chunks the arena still holds
        self._fault: tuple[str, int] | None = None
        self.armed: tuple[str, int] | None = None  # the failure armed last (kept once it fired)
        self._lock = threading.Lock()

    def arm(self, method: str | None = None, k: int = 0) -> None:
        """Starts counting calls from zero; the ``k``-th call of ``method`` (if given) fails."""
        assert method is None or method in COUNTED, method
        self.calls.clear()
        self.phases.clear()
        self.is_counting = True
        self._fault = self.armed = None if method is None else (method, k)

    def disarm(self) -> None:
        self.is_counting, self._fault = False, None

    @property
    def is_spent(self) -> bool:
        """Whether the armed failure has been raised."""
        return self._fault is None

    def tick(self, method: str) -> None:
        """Counts a call of ``method``; raises if it is the one that must fail."""
        with self._lock:
            if not self.is_counting:
                return
            self.calls[method] += 1
            self.phases.setdefault(method, []).append(self.phase)
            if self._fault != (method, self.calls[method]):
                return
            self._fault = None
        raise DriverError(f"{method}: injected failure at call {self.calls[method]}")

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name not in COUNTED:
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.tick(name)
            return value(*args, **kwargs)

        return counted

    def copy_batch(self, path: CopyPath = CopyPath.COPY_ENGINE) -> _FaultyCopies:
        return _FaultyCopies(self, self.inner.copy_batch(path))

    def hash_batch(self) -> _FaultyHashes:
        return _FaultyHashes(self, self.inner.hash_batch())

    def pin(self, address: int, size: int) -> None:
        self.tick("pin")
        self.inner.pin(address, size)
        with self._lock:
            self.num_pinned += 1

    def unpin(self, address: int, size: int) -> None:
        self.inner.unpin(address, size)
        with self._lock:
            self.num_pinned -= 1


class _FaultyCopies:
    def __init__(self, backend: FaultyBackend, inner: Any) -> None:
        self._backend, self._inner = backend, inner

    def add(self, copy: Copy) -> int:
        self._backend.tick("copy_batch.add")
        return int(self._inner.add(copy))

    def wait(self, index: int) -> None:
        self._backend.tick("copy_batch.wait")
        self._inner.wait(index)

    def wait_all(self) -> None:
        self._backend.tick("copy_batch.wait_all")
        self._inner.wait_all()


class _FaultyHashes:
    def __init__(self, backend: FaultyBackend, inner: Any) -> None:
        self._backend, self._inner = backend, inner

    def add(self, spans: Sequence[Span]) -> int:
        self._backend.tick("hash_batch.add")
        return int(self._inner.add(spans))

    def wait(self, index: int) -> list[bytes]:
        self._backend.tick("hash_batch.wait")
        return list(self._inner.wait(index))


def check_truth(mm: MemoryManager, backend: FaultyBackend) -> None:
    """Asserts that every allocation's recorded state is what the backend really has, that the
    status and tag states derive from them, and that no handle is held that nobody records."""
    host = backend.inner
    handles, mapped, reservations = (
        host.live_handles(),
        host.mapped_ranges(),
        host.live_reservations(),
    )
    allocations = list(mm._table.allocations())
    for a in allocations:
        where = f"{a.tag} allocation at {a.va:#x} ({a.state.name})"
        assert reservations.get(a.va) == a.reserved >= a.size, f"{where}: VA not reserved"
        is_mapped = a.state is State.MAPPED
        assert (a.va in mapped) == is_mapped, f"{where}: backend mapped={a.va in mapped}"
        if is_mapped:
            assert mapped[a.va] == (a.size, a.handle), f"{where}: mapped to another handle"
        holds = a.state in (State.MAPPED, State.UNMAPPED)
        assert (a.handle is not None) == holds, f"{where}: handle {a.handle}"
        if holds:
            assert handles.get(a.handle) == a.size, f"{where}: handle {a.handle} is not live"
        if a.state is State.OFFLOADED:
            assert a.has_host_copy, f"{where}: offloaded without a complete host copy"
        assert (a.pending is not None) == (a.state is State.UNMAPPED), f"{where}: {a.pending}"
    dying = list(mm._table.dying)  # no block left, their free failed: as the failure left them
    for a in dying:
        where = f"unfreed {a.tag} allocation at {a.va:#x} ({a.state.name})"
        assert reservations.get(a.va) == a.reserved, f"{where}: VA not reserved"
        assert (a.va in mapped) == (a.state is State.MAPPED), f"{where}: mapped={a.va in mapped}"
        assert a.handle is None or handles.get(a.handle) == a.size, f"{where}: handle not live"
        assert a.region is None, f"{where}: still holds a host copy"
    every = allocations + dying
    recorded = {a.handle for a in every if a.handle is not None}
    assert set(handles) == recorded, f"stray handles {set(handles) - recorded}"
    assert set(mapped) == {a.va for a in every if a.state is State.MAPPED}
    assert set(reservations) == {a.va for a in every}, "stray reservations"
    status = mm.status()
    states = mm.tag_states()
    for tag_status in status.tags:
        mine = [a for a in allocations if a.tag == tag_status.tag]
        assert tag_status.state is states[tag_status.tag] is tag_state(mine)
        for state in State:
            assert tag_status.num_by_state[state] == sum(a.state is state for a in mine)
        expected_mapped = sum(a.size for a in mine if a.va in mapped)
        assert tag_status.mapped_bytes == expected_mapped, tag_status
        assert mm.is_sleeping(tag_status.tag) == (tag_status.state is not TagState.AWAKE)
    assert status.device_used_bytes == sum(handles.values())
    assert status.unfreed_bytes == sum(a.size for a in dying if a.handle is not None)


def touch_all(tensors: Sequence[Any]) -> None:
    """Reads every byte of every tensor (a segfault if any of it is not mapped)."""
    for tensor in tensors:
        tensor.reshape(-1).view(torch.uint8).sum()


def expect_driver_error(call: Callable[[], object]) -> DriverError:
    """Runs ``call``; returns the DriverError it raised (fails if it raised nothing else)."""
    try:
        call()
    except DriverError as error:
        return error
    raise AssertionError("expected a DriverError")
