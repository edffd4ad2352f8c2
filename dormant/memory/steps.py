"""The recorded steps that sleep (``offload.py``) and wake (``transitions.py``) share.

Releasing one allocation is two recorded steps: unmap (→ UNMAPPED, handle kept), then release
(→ OFFLOADED or DISCARDED). An allocation that is already UNMAPPED only retries the release.
Each step is recorded as soon as its driver call returns, so a failure leaves the truth behind.
"""

from __future__ import annotations

import time

from dormant.memory.allocation import Allocation, State
from dormant.memory.arena import Region
from dormant.memory.backend import Backend, CopyBatch
from dormant.memory.policy import Policy
from dormant.memory.release_history import ReleaseHistory


def unmap(backend: Backend, allocation: Allocation, policy: Policy) -> None:
    """MAPPED → UNMAPPED on its way to ``policy`` (no-op for an allocation already UNMAPPED)."""
    if allocation.state is State.MAPPED:
        backend.unmap(allocation.va, allocation.size)
        allocation.state, allocation.pending = State.UNMAPPED, policy


def release(backend: Backend, allocation: Allocation, policy: Policy) -> None:
    """Unmap (unless already UNMAPPED), then release; each step recorded as it lands."""
    unmap(backend, allocation, policy)
    backend.release(handle_of(allocation))
    allocation.handle, allocation.pending = None, None
    allocation.state = State.OFFLOADED if policy is Policy.HOST else State.DISCARDED


class ReleaseClock:
    """Releases allocations and adds up the wall time spent in the driver's unmap and release
    calls: ``release_s`` for all of them, ``discard_s`` for the DISCARD ones. Each release that
    lands is noted in ``history`` (the wake's copy path reads it: copy_path.py). Thread-safe for
    one releasing thread besides the caller's, each adding to its own fields (see offload.py)."""

    def __init__(self, backend: Backend, history: ReleaseHistory | None = None) -> None:
        self.backend = backend
        self.history = ReleaseHistory() if history is None else history
        self.release_s = 0.0  # HOST releases (unchanged, or once their copy landed)
        self.discard_s = 0.0  # DISCARD unmaps and releases

    def release(self, allocation: Allocation, policy: Policy) -> None:
        start = time.perf_counter()
        try:
            release(self.backend, allocation, policy)
        finally:
            self._add(policy, time.perf_counter() - start)
        self.history.record(allocation.size)

    def unmap(self, allocation: Allocation, policy: Policy) -> None:
        start = time.perf_counter()
        try:
            unmap(self.backend, allocation, policy)
        finally:
            self._add(policy, time.perf_counter() - start)

    def _add(self, policy: Policy, seconds: float) -> None:
        if policy is Policy.DISCARD:
            self.discard_s += seconds
        else:
            self.release_s += seconds


def drain(batch: CopyBatch, error: BaseException) -> None:
    """Waits for the copies of a failed sleep or wake, so none outlives its batch; a failure to
    wait is added to ``error`` as a note (never swallowed), and ``error`` is what is raised."""
    try:
        batch.wait_all()
    except Exception as wait_error:
        error.add_note(f"waiting for the copies after that failed also failed: {wait_error!r}")


def handle_of(allocation: Allocation) -> int:
    assert allocation.handle is not None, "a MAPPED or UNMAPPED allocation holds its handle"
    return allocation.handle


def region_of(allocation: Allocation) -> Region:
    assert allocation.region is not None, "a HOST allocation always has an arena region"
    return allocation.region
