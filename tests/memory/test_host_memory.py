"""Memory really goes away while asleep, and the host arena is reused rather than regrown."""

from __future__ import annotations

import gc

import psutil
import torch

from dormant.memory import MemoryManager
from tests.memory.helpers import random_fill, same_bytes

MiB = 1 << 20


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_rss_goes_down_while_asleep_and_comes_back_on_wake() -> None:
    mm = MemoryManager("host")
    try:
        kv = mm.empty((256 * MiB,), torch.uint8, "kv_cache")
        kv.fill_(1)  # touch every page
        awake = rss()
        mm.sleep(level=1)
        asleep = rss()
        assert awake - asleep > 200 * MiB, (awake, asleep)
        mm.wake_up()
        kv.fill_(2)
        assert rss() - asleep > 200 * MiB
    finally:
        mm.close()


def test_backend_memory_is_released_for_both_policies() -> None:
    mm = MemoryManager("host")
    try:
        live = [mm.empty((32 * MiB,), torch.uint8, tag) for tag in ("weights", "kv_cache")]
        assert mm.backend.used_bytes == 64 * MiB
        mm.sleep(level=1)
        assert mm.backend.used_bytes == 0
        assert mm.status().device_used_bytes == 0
        mm.wake_up()
        assert mm.backend.used_bytes == 64 * MiB
        del live
    finally:
        mm.close()


def test_arena_does_not_grow_over_50_cycles() -> None:
    mm = MemoryManager("host", skip_unchanged=False)  # copy every time: the worst case
    try:
        tensors = [mm.empty((n,), torch.uint8, "weights") for n in (3 * MiB, 5 * MiB, 1000)]
        expected = [random_fill(t, i) for i, t in enumerate(tensors)]
        mm.sleep(level=1)
        mm.wake_up()
        capacity, chunks = mm.arena.capacity_bytes, mm.arena.num_chunks
        for _ in range(50):
            mm.sleep(level=1)
            mm.wake_up()
        assert (mm.arena.capacity_bytes, mm.arena.num_chunks) == (capacity, chunks)
        for t, e in zip(tensors, expected, strict=True):
            assert same_bytes(t, e)
    finally:
        mm.close()


def test_arena_regions_are_reused_after_free() -> None:
    mm = MemoryManager("host")
    try:
        a = mm.empty((4 * MiB,), torch.uint8, "weights")
        mm.sleep(level=1)
        mm.wake_up()
        capacity = mm.arena.capacity_bytes
        del a
        gc.collect()
        assert mm.arena.used_bytes == 0
        b = mm.empty((4 * MiB,), torch.uint8, "weights")
        mm.sleep(level=1)
        mm.wake_up()
        assert mm.arena.capacity_bytes == capacity
        del b
    finally:
        mm.close()


def test_release_arena_after_wake_option() -> None:
    mm = MemoryManager("host", keep_arena=False)
    try:
        w = mm.empty((8 * MiB,), torch.uint8, "weights")
        table = mm.empty((100,), torch.int32, "runtime")
        expected = random_fill(w, 5)
        mm.sleep(level=1)
        assert mm.arena.capacity_bytes >= 8 * MiB
        mm.wake_up(["weights"])
        assert mm.arena.capacity_bytes > 0  # runtime is still offloaded: keep the arena
        mm.wake_up()
        assert mm.arena.capacity_bytes == 0 and mm.status().tag("weights").host_bytes == 0
        assert same_bytes(w, expected)
        report = mm.sleep(level=1)  # no host copy survives: everything is copied again
        assert report.bytes_skipped == 0 and report.bytes_copied >= 8 * MiB
        mm.wake_up()
        assert same_bytes(w, expected)
        del table
    finally:
        mm.close()
