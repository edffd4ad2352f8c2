"""A driver call that fails while a dead block's memory is freed (found by a review).

Before the fix the block's record went first, so the failure orphaned the allocation: the books
were untrue, its tag read PARTIAL (new tensors of it refused), its bytes were later reported lost,
``close()`` left its handle and reservation live, and the error was only printed by the DLPack
deleter. Now the allocation leaves its pool whatever happens and, when its destruction fails,
waits in the table's ``dying`` list, described as the failure left it: ``status()`` lists it as
unfreed, the next call retries it, and a retry that fails again raises ``FreeFailedError``.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import pytest
import torch

from dormant.memory import FreeFailedError, MemoryManager, TagState
from dormant.memory.host_backend import HostBackend
from dormant.memory.status_report import UNFREED
from tests.memory.faults import FaultyBackend, check_truth

KiB = 1 << 10
# Every call that destroying an allocation makes, in order (pin/unpin are the arena's).
DESTROY_CALLS = ["synchronize", "unmap", "release", "free_reservation"]
OWN, SLAB = 200 * KiB, 4 * KiB  # a block with an allocation of its own; one carved from a slab


@pytest.fixture
def backend() -> FaultyBackend:
    return FaultyBackend(HostBackend(granularity=64 * KiB))


@pytest.fixture
def mm(backend: FaultyBackend) -> Iterator[MemoryManager]:
    manager = MemoryManager(backend, slab_bytes=64 * KiB, max_slab_bytes=1 << 20)
    yield manager
    backend.disarm()
    manager.close()  # retries any free still waiting (a closed one returns at once)


def assert_nothing_leaked(backend: FaultyBackend) -> None:
    host = backend.inner
    assert not host.live_handles() and not host.mapped_ranges() and not host.live_reservations()


def free_failing(mm: MemoryManager, backend: FaultyBackend, nbytes: int, call: str) -> None:
    """Makes a tensor of ``nbytes`` in "weights" and lets it die with ``call`` failing."""
    tensor = mm.empty((nbytes,), torch.uint8, "weights")
    backend.arm(call, 1)
    del tensor
    gc.collect()
    assert backend.is_spent, f"{call} was never called"
    backend.disarm()


@pytest.mark.parametrize("nbytes", [OWN, SLAB], ids=["own", "slab"])
@pytest.mark.parametrize("call", DESTROY_CALLS)
def test_a_failed_free_is_kept_listed_and_retried_by_the_next_call(
    mm: MemoryManager,
    backend: FaultyBackend,
    call: str,
    nbytes: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="dormant.memory.frontends"):
        free_failing(mm, backend, nbytes, call)
    assert "injected failure" in caplog.text and "retries the free" in caplog.text
    check_truth(mm, backend)  # the dying allocation is described as the failure left it
    assert len(mm._table.dying) == 1
    status = mm.status()
    held = call in ("synchronize", "unmap", "release")
    assert status.unfreed_bytes == (64 * KiB if nbytes == SLAB else OWN + 56 * KiB) * held
    assert any(r.owner == UNFREED for r in status.residual) == held
    assert mm.tag_states()["weights"] is TagState.AWAKE  # the tag is not PARTIAL

    mm.empty((64,), torch.uint8, "weights")  # the tag takes new tensors; the retry lands first
    assert not mm._table.dying
    check_truth(mm, backend)
    assert mm.status().unfreed_bytes == 0
    mm.close()
    gc.collect()
    assert_nothing_leaked(backend)


def test_a_retry_that_fails_again_raises_from_the_next_call_which_changes_nothing(
    mm: MemoryManager, backend: FaultyBackend
) -> None:
    keep = mm.empty((1000,), torch.uint8, "kv_cache")
    free_failing(mm, backend, OWN, "release")
    backend.arm("release", 1)  # the retry fails too
    with pytest.raises(FreeFailedError, match="retries the free"):
        mm.sleep(level=1)
    backend.disarm()
    assert mm.tag_states()["kv_cache"] is TagState.AWAKE and mm.last_sleep is None
    check_truth(mm, backend)
    mm.sleep(level=1)  # the retry lands, then the sleep runs
    assert not mm._table.dying
    mm.wake_up()
    check_truth(mm, backend)
    del keep


def test_raw_free_raises_its_own_failure_and_the_block_is_gone(
    mm: MemoryManager, backend: FaultyBackend
) -> None:
    address = mm.raw_alloc(OWN, "runtime")
    backend.arm("unmap", 1)
    with pytest.raises(FreeFailedError, match="injected failure"):
        mm.raw_free(address)
    backend.disarm()
    check_truth(mm, backend)
    with pytest.raises(ValueError, match="not a live raw allocation"):
        mm.raw_free(address)  # freed once: the block is gone, only its memory waits
    mm.audit()  # the next call retries it
    assert not mm._table.dying
    check_truth(mm, backend)


def test_a_free_that_fails_at_the_exit_of_another_call_is_not_raised_there(
    mm: MemoryManager, backend: FaultyBackend
) -> None:
    """A storage that dies while the manager's lock is held is freed by whoever leaves the lock:
    its failure is not that caller's."""
    tensor = mm.empty((OWN,), torch.uint8, "weights")
    backend.arm("release", 1)
    with mm._serial.held():
        del tensor
        gc.collect()  # queued: the lock is held
    backend.disarm()
    assert len(mm._table.dying) == 1
    check_truth(mm, backend)


def test_close_raises_a_free_that_still_fails_and_a_later_free_finishes_it(
    mm: MemoryManager, backend: FaultyBackend
) -> None:
    survivor = mm.empty((SLAB,), torch.uint8, "runtime")
    free_failing(mm, backend, OWN, "free_reservation")
    backend.arm("free_reservation", 1)
    with pytest.raises(FreeFailedError):
        mm.close()
    backend.disarm()
    assert len(mm._table.dying) == 1
    del survivor  # the last free after close retries what is left, then the arena goes
    gc.collect()
    assert not mm._table.dying and mm._table.is_empty
    assert_nothing_leaked(backend)
