"""The scope audit, strict mode and the pointer guard (DESIGN §2.5)."""

from __future__ import annotations

import pytest
import torch

from dormant.memory import MemoryManager, PointerGuardError, StrictModeError
from tests.memory.helpers import random_fill, same_bytes


def allocate_block_tables_the_wrong_way(mm: MemoryManager) -> int:
    """Metadata allocated through a raw (capture-style) path into the KV-cache tag."""
    return mm.raw_alloc(4096, "kv_cache")


def test_audit_lists_discardable_allocations_with_call_sites(mm: MemoryManager) -> None:
    kv = mm.empty((1 << 20,), torch.uint8, "kv_cache")
    table = mm.empty((64,), torch.int32, "runtime")
    address = allocate_block_tables_the_wrong_way(mm)
    report = mm.audit()
    tags = {r.tag for r in report.records}
    assert "kv_cache" in tags and "runtime" not in tags  # runtime is never discarded
    raw = [r for r in report.records if r.address == address]
    assert len(raw) == 1 and not raw[0].is_declared and raw[0].nbytes == 4096
    assert "test_safety.py" in raw[0].site and "allocate_block_tables_the_wrong_way" in raw[0].site
    explicit = [r for r in report.records if r.address == kv.data_ptr()]
    assert explicit[0].is_declared and "test_safety.py" in explicit[0].site
    assert report.undeclared == tuple(raw)
    assert "NO" in str(report) and "kv_cache" in str(report)
    assert mm.audit(["runtime"]).records[0].address == table.data_ptr()
    mm.raw_free(address)
    assert not mm.audit().undeclared


def test_strict_mode_refuses_to_discard_undeclared_memory(make_mm) -> None:
    mm = make_mm(strict=True)
    kv = mm.empty((1 << 20,), torch.uint8, "kv_cache")
    address = allocate_block_tables_the_wrong_way(mm)
    with pytest.raises(StrictModeError, match="allocate_block_tables_the_wrong_way") as caught:
        mm.sleep(level=1)
    assert f"{address:#x}" in str(caught.value)
    assert not mm.is_sleeping()  # nothing changed
    mm.sleep(tags={"weights": "host"})  # tags without undeclared memory still sleep
    mm.wake_up()
    mm.raw_free(address)
    mm.sleep(level=1)
    mm.wake_up()
    del kv


def test_declare_backing_satisfies_strict_mode(make_mm) -> None:
    mm = make_mm(strict=True)
    address = mm.raw_alloc(4096, "kv_cache")
    with pytest.raises(ValueError, match="not memory"):
        mm.declare_backing(torch.zeros(4))
    mm.declare_backing(address)
    assert not mm.audit().undeclared
    mm.sleep(level=1)
    mm.wake_up()
    mm.raw_free(address)


def test_declare_backing_by_tensor(make_mm) -> None:
    mm = make_mm(strict=True)
    kv = mm.empty((1 << 20,), torch.uint8, "kv_cache")
    mm.declare_backing(kv[100:200])  # any view inside the block declares the whole block
    mm.sleep(level=1)
    mm.wake_up()


def test_pointer_guard_accepts_unchanged_addresses(mm: MemoryManager) -> None:
    table = mm.empty((64,), torch.int32, "runtime")
    mm.guard_addresses("block_tables", [table])
    for _ in range(3):
        mm.sleep(level=1)
        mm.wake_up()
    mm.verify_guards()


def test_pointer_guard_catches_a_rebuilt_tensor(mm: MemoryManager) -> None:
    class Runner:
        def __init__(self) -> None:
            self.block_table = mm.empty((64,), torch.int32, "runtime")

    runner = Runner()
    expected = random_fill(runner.block_table, 1)
    mm.guard_addresses("block_table", lambda: [runner.block_table])
    mm.sleep(level=1)
    mm.wake_up()
    # The failed prior-art fix: rebuild the tensor after wake, at a new address.
    old = runner.block_table
    runner.block_table = mm.empty((64,), torch.int32, "runtime")
    with pytest.raises(PointerGuardError, match=r"block_table\[0\]"):
        mm.sleep(level=1)
    assert not mm.is_sleeping()  # the failed check changed nothing
    runner.block_table = old
    mm.sleep(level=1)
    mm.wake_up()
    assert same_bytes(runner.block_table, expected)


def test_pointer_guard_catches_storage_swaps_and_is_checked_at_wake(mm: MemoryManager) -> None:
    table = mm.empty((64,), torch.int32, "runtime")
    kv = mm.empty((64,), torch.int32, "kv_cache")
    mm.guard_addresses("table", [table])
    mm.sleep(tags={"kv_cache": "discard"})
    table.set_(torch.zeros(64, dtype=torch.int32, device=mm.backend.device))
    with pytest.raises(PointerGuardError):
        mm.wake_up()
    assert mm.is_sleeping("kv_cache")  # the failed wake changed nothing
    mm.unguard("table")
    mm.wake_up()
    with pytest.raises(KeyError):
        mm.unguard("table")
    del kv


def test_capture_needs_the_cuda_backend() -> None:
    from dormant.memory import MemoryLayerError

    mm = MemoryManager("host")
    try:
        with pytest.raises(MemoryLayerError, match="cuda backend"), mm.capture("kv_cache"):
            pass
        with pytest.raises(MemoryLayerError, match="cuda backend"):
            mm.graph_pool()
    finally:
        mm.close()


def test_raw_free_after_close_returns_the_memory() -> None:
    """A capture pool gives its memory back when its last user dies, which can be after the
    manager closed: raw_free must still work then."""
    mm = MemoryManager("host")
    address = mm.raw_alloc(4 << 20, "cuda_graph")
    mm.close()
    mm.raw_free(address)
    assert mm.backend.used_bytes == 0
