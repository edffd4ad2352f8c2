"""The sender's ref-counter files, mapped once (``dormant/worker/ipc_counters.py``), against a
real file laid out as torch's (``RefcountedMapAllocator``'s 64-byte header, then the slots)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dormant.worker import ipc_counters
from dormant.worker.ipc_counters import FILE_BYTES, HEADER_BYTES, REF_COUNTER_SLOTS, RefCounterFiles
from dormant.worker.transfer_errors import WeightTransferError


def counter_file(root: Path, name: bytes, size: int = FILE_BYTES) -> np.memmap:
    path = root / name[1:].decode()
    path.write_bytes(bytes(size))
    slots = np.memmap(path, np.int64, "r+", HEADER_BYTES, (REF_COUNTER_SLOTS,))
    slots[:] = 1
    return slots


def header(root: Path, name: bytes) -> bytes:
    return (root / name[1:].decode()).read_bytes()[:HEADER_BYTES]


def test_a_release_decrements_its_slot_once_and_maps_the_file_once(tmp_path: Path) -> None:
    slots = counter_file(tmp_path, b"/torch_7_8_0")
    files = RefCounterFiles(str(tmp_path), fallback=_no_fallback)
    for slot in (0, 1, 2, REF_COUNTER_SLOTS - 1):
        files.release(b"/torch_7_8_0", slot)
    assert slots[[0, 1, 2, REF_COUNTER_SLOTS - 1]].tolist() == [0, 0, 0, 0]
    assert slots[3] == 1 and int(slots.sum()) == REF_COUNTER_SLOTS - 4
    assert header(tmp_path, b"/torch_7_8_0") == bytes(HEADER_BYTES)  # the header untouched
    assert files.num_mapped == 1 and files.num_released == 4 and files.num_open == 1
    files.close()
    assert files.num_open == 0
    files.release(b"/torch_7_8_0", 3)  # mapped again after a close
    assert slots[3] == 0 and files.num_mapped == 2


def test_the_oldest_file_is_unmapped_past_the_limit(tmp_path: Path) -> None:
    names = [b"/torch_1_1_%d" % i for i in range(ipc_counters.MAX_FILES + 2)]
    all_slots = [counter_file(tmp_path, name) for name in names]
    files = RefCounterFiles(str(tmp_path), fallback=_no_fallback)
    for name in names:
        files.release(name, 5)
    assert files.num_open == ipc_counters.MAX_FILES and files.num_mapped == len(names)
    files.release(names[0], 6)  # evicted: mapped again
    assert files.num_mapped == len(names) + 1
    assert [int(s[5]) for s in all_slots] == [0] * len(names) and all_slots[0][6] == 0


@pytest.mark.parametrize(
    "name",
    [b"/missing", b"/torch_small", b"torch_no_slash", b"/a/../b", "/torch_str", b"/.."],
)
def test_a_file_it_cannot_map_falls_back_to_torch(tmp_path: Path, name: object) -> None:
    (tmp_path / "torch_small").write_bytes(bytes(FILE_BYTES - 8))  # short of 10000 slots
    calls: list[tuple[object, int]] = []
    files = RefCounterFiles(str(tmp_path), fallback=lambda n, s: calls.append((n, s)))
    files.release(name, 4)  # type: ignore[arg-type]
    assert calls == [(name, 4)] and files.num_open == 0 and files.num_released == 1


@pytest.mark.parametrize("slot", [-1, REF_COUNTER_SLOTS, 2.0, True])
def test_a_slot_outside_the_file_is_refused_before_any_write(tmp_path: Path, slot) -> None:
    slots = counter_file(tmp_path, b"/torch_3_3_3")
    files = RefCounterFiles(str(tmp_path), fallback=_no_fallback)
    with pytest.raises(WeightTransferError, match="ref-counter slot"):
        files.release(b"/torch_3_3_3", slot)
    assert int(slots.sum()) == REF_COUNTER_SLOTS and files.num_open == files.num_released == 0


def _no_fallback(name: bytes, slot: int) -> None:
    raise AssertionError(f"fell back to torch for {name!r}")
