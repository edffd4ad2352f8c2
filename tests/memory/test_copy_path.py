"""The wake's copy path (issue 17): the policy's decision from the release history (with a
stand-in clock), the SM copy's pieces, the hybrid split, and the wake report naming the path,
on the host backend (whose SM path runs the same elementwise copy on CPU tensors)."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from dormant.memory import (
    CopyMode,
    CopyPath,
    CopyPathPolicy,
    CopyPolicyError,
    MemoryManager,
    Policy,
)
from dormant.memory import host_backend as host_backend_module
from dormant.memory.backend import Copy
from dormant.memory.copy_path import ENV_VAR, GiB
from dormant.memory.host_backend import HostBackend
from dormant.memory.host_mappings import HostMappings
from dormant.memory.path_copies import SPLIT_ALIGNMENT, PathCopies, split_copy
from dormant.memory.release_history import ReleaseHistory
from dormant.memory.sm_copy import plan_pieces, sm_copy
from tests.memory.helpers import random_fill, same_bytes

MiB = 1 << 20


class Clock:
    """A stand-in for time.monotonic that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def count_sm_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte count of every SM copy the host backend runs from now on."""
    ran: list[int] = []

    def counted(dst: int, src: int, nbytes: int, device: torch.device) -> None:
        ran.append(nbytes)
        sm_copy(dst, src, nbytes, device)

    monkeypatch.setattr(host_backend_module, "sm_copy", counted)
    return ran


def history_with(clock: Clock, *releases: tuple[float, int]) -> ReleaseHistory:
    """A history holding ``releases`` as (seconds before now, bytes)."""
    history = ReleaseHistory(clock)
    now = clock.now
    for ago, nbytes in sorted(releases, reverse=True):
        clock.now = now - ago
        history.record(nbytes)
    clock.now = now
    return history


# ── the decision ─────────────────────────────────────────────────────────────────────────────
def test_auto_takes_the_sm_path_right_after_a_large_release(clock: Clock) -> None:
    policy = CopyPathPolicy()
    history = history_with(clock, (0.05, 60 * GiB))
    assert policy.choose(history) == (CopyPath.SM, 60 * GiB)
    clock.now += 0.44  # 0.49 s after: still inside the 0.5 s window
    assert policy.choose(history).path is CopyPath.SM
    clock.now += 0.02  # 0.51 s after
    assert policy.choose(history) == (CopyPath.COPY_ENGINE, 0)


def test_auto_keeps_the_copy_engines_after_small_or_old_releases(clock: Clock) -> None:
    policy = CopyPathPolicy()
    assert policy.choose(ReleaseHistory(clock)).path is CopyPath.COPY_ENGINE  # none at all
    small = history_with(clock, (0.01, 8 * GiB), (0.02, 4 * GiB))
    assert policy.choose(small) == (CopyPath.COPY_ENGINE, 12 * GiB)
    weights_only = history_with(clock, (0.0, 16 * GiB))  # cost ~9 ms by the copy engines
    assert policy.choose(weights_only).path is CopyPath.COPY_ENGINE
    old = history_with(clock, (0.6, 60 * GiB), (0.01, 1 * GiB))
    assert policy.choose(old) == (CopyPath.COPY_ENGINE, 1 * GiB)


def test_auto_adds_up_the_releases_inside_the_window(clock: Clock) -> None:
    """A sleep releases allocation by allocation: the sum is what the driver reclaims."""
    history = history_with(clock, *[(0.01 * i, 5 * GiB) for i in range(10)])
    assert CopyPathPolicy().choose(history) == (CopyPath.SM, 50 * GiB)
    assert (
        CopyPathPolicy().choose(history_with(clock, (0.0, 40 * GiB))).path is CopyPath.COPY_ENGINE
    )
    tuned = CopyPathPolicy(window_s=0.035, min_release_bytes=8 * GiB, busy_path=CopyPath.HYBRID)
    assert tuned.choose(history) == (CopyPath.HYBRID, 20 * GiB)  # the releases 0-0.03 s ago


@pytest.mark.parametrize("mode", [CopyMode.COPY_ENGINE, CopyMode.SM, CopyMode.HYBRID])
def test_a_forced_mode_ignores_the_history(clock: Clock, mode: CopyMode) -> None:
    policy = CopyPathPolicy(mode=mode)
    for history in (ReleaseHistory(clock), history_with(clock, (0.0, 75 * GiB))):
        assert policy.choose(history).path is CopyPath(mode.value)


def test_modes_parse_from_names_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CopyPathPolicy.parse("SM").mode is CopyMode.SM
    assert CopyPathPolicy.parse(CopyPath.HYBRID).mode is CopyMode.HYBRID
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert CopyPathPolicy.parse(None) == CopyPathPolicy()
    monkeypatch.setenv(ENV_VAR, "copy_engine")
    assert CopyPathPolicy.parse(None).mode is CopyMode.COPY_ENGINE
    monkeypatch.setenv(ENV_VAR, "dma")
    with pytest.raises(CopyPolicyError, match="unknown copy mode 'dma'"):
        CopyPathPolicy.parse(None)


@pytest.mark.parametrize(
    "options",
    [{"window_s": -1.0}, {"min_release_bytes": -1}, {"sm_fraction": 1.0}, {"mode": "sm"}],
)
def test_an_invalid_policy_raises(options: dict[str, object]) -> None:
    with pytest.raises(CopyPolicyError):
        CopyPathPolicy(**options)  # type: ignore[arg-type]


def test_the_manager_refuses_an_unknown_mode_and_keeps_its_policy() -> None:
    mm = MemoryManager("host", copy_policy="sm")
    with pytest.raises(CopyPolicyError):
        mm.copy_policy = "fastest"
    assert mm.copy_policy.mode is CopyMode.SM
    mm.close()


# ── the SM copy ──────────────────────────────────────────────────────────────────────────────
def test_pieces_cover_the_range_in_order_and_are_aligned() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        dst, src = rng.randrange(1 << 20), rng.randrange(1 << 20)
        nbytes = rng.choice([0, 1, 3, 15, 16, 17, 33, 4096, rng.randrange(1, 5000)])
        pieces = plan_pieces(dst, src, nbytes)
        assert sum(p.nbytes for p in pieces) == nbytes
        offset = 0
        for piece in pieces:
            assert piece.offset == offset
            size = piece.dtype.itemsize
            assert piece.nbytes % size == 0
            assert (dst + offset) % size == 0 and (src + offset) % size == 0
            offset += piece.nbytes
        assert len(pieces) <= 3


def test_an_aligned_range_is_one_word_piece_that_starts_16_byte_aligned() -> None:
    assert [(p.nbytes, p.dtype) for p in plan_pieces(4096, 8192, 2 * MiB)] == [
        (2 * MiB, torch.int32)
    ]
    head, body, tail = plan_pieces(4096 + 3, 8192 + 3, 100)
    assert (head.nbytes, body.dtype, (4096 + 3 + body.offset) % 16) == (13, torch.int32, 0)
    assert tail.nbytes == 3 and plan_pieces(1, 2, 10)[0].dtype is torch.uint8  # odd distance


@pytest.mark.parametrize("dst_offset,src_offset", [(0, 0), (3, 3), (1, 2), (2, 0), (5, 13)])
@pytest.mark.parametrize("nbytes", [1, 7, 16, 31, 4099, MiB + 5])
def test_sm_copy_is_bit_exact_at_odd_sizes_and_offsets(
    dst_offset: int, src_offset: int, nbytes: int
) -> None:
    src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 64, dtype=torch.uint8)
    sm_copy(dst.data_ptr() + dst_offset, src.data_ptr() + src_offset, nbytes, torch.device("cpu"))
    assert torch.equal(dst[dst_offset : dst_offset + nbytes], src[src_offset : src_offset + nbytes])
    assert not dst[:dst_offset].any() and not dst[dst_offset + nbytes :].any()  # nothing else


def test_host_mappings_translate_inside_registered_ranges_only() -> None:
    mappings = HostMappings()
    mappings.add(0x10000, 0x1000, 0x900000)
    mappings.add(0x30000, 0x2000, 0x30000)  # the H200's case: device pointer == host pointer
    assert mappings.device_address(0x10000) == 0x900000
    assert mappings.device_address(0x10FFF) == 0x900FFF
    assert mappings.device_address(0x11000) == 0x11000  # past the range: device memory
    assert mappings.device_address(0x31000) == 0x31000
    assert mappings.device_address(0x100) == 0x100
    mappings.remove(0x10000)
    assert mappings.device_address(0x10000) == 0x10000


# ── the hybrid split ─────────────────────────────────────────────────────────────────────────
def test_split_copy_gives_the_sm_kernels_the_tail() -> None:
    engine, sm = split_copy(Copy(1 << 30, 2 << 30, 2 * MiB + 7), 0.5)
    assert engine is not None and sm is not None
    assert sm.nbytes == MiB and sm.nbytes % SPLIT_ALIGNMENT == 0
    assert engine.nbytes + sm.nbytes == 2 * MiB + 7 and sm.dst == engine.dst + engine.nbytes
    assert split_copy(Copy(0, 0, SPLIT_ALIGNMENT), 0.5) == (Copy(0, 0, SPLIT_ALIGNMENT), None)


@pytest.mark.parametrize("path", list(CopyPath))
def test_path_copies_are_bit_exact_and_count_bytes_by_path(
    monkeypatch: pytest.MonkeyPatch, path: CopyPath
) -> None:
    ran = count_sm_copies(monkeypatch)
    sizes = [4 * MiB, 3 * MiB + 11, 100]
    src = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    dst = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    batch = PathCopies(HostBackend(), path, 0.25)
    for d, s in zip(dst, src, strict=True):
        batch.add(Copy(d.data_ptr(), s.data_ptr(), s.numel()))
    batch.wait(1)
    batch.wait_all()
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    by_path = batch.bytes_by_path
    assert by_path[CopyPath.COPY_ENGINE] + by_path[CopyPath.SM] == sum(sizes)
    assert sum(ran) == by_path[CopyPath.SM]
    expected_sm = {
        CopyPath.COPY_ENGINE: 0,
        CopyPath.SM: sum(sizes),
        CopyPath.HYBRID: MiB + (3 * MiB + 11) // 4 // SPLIT_ALIGNMENT * SPLIT_ALIGNMENT,
    }
    assert by_path[CopyPath.SM] == expected_sm[path]  # fmt: skip


# ── the wake ─────────────────────────────────────────────────────────────────────────────────
def sleep_with_large_release(mm: MemoryManager, clock: Clock) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (HOST) and a KV cache of 8 MiB that a level-1 sleep discards, on ``clock``."""
    mm.release_history.clock = clock
    weights = mm.empty((3 * MiB + 5,), torch.uint8, "weights")
    expected = random_fill(weights, seed=1)
    kv = mm.empty((8 * MiB,), torch.uint8, "kv_cache")
    mm.sleep(tags={"weights": Policy.HOST, "kv_cache": Policy.DISCARD})
    del kv
    return weights, expected


@pytest.fixture
def policy() -> CopyPathPolicy:
    """The default policy, its threshold scaled to this test's 8 MiB KV cache."""
    return CopyPathPolicy(min_release_bytes=8 * MiB)


@pytest.mark.parametrize(
    ("after_s", "path"), [(0.1, CopyPath.SM), (0.51, CopyPath.COPY_ENGINE)]
)  # inside the default 0.5 s window, and past it
def test_a_wake_after_a_large_release_copies_by_the_path_it_calls_for(
    monkeypatch: pytest.MonkeyPatch,
    clock: Clock,
    policy: CopyPathPolicy,
    after_s: float,
    path: CopyPath,
) -> None:
    ran = count_sm_copies(monkeypatch)
    mm = MemoryManager("host", copy_policy=policy)
    weights, expected = sleep_with_large_release(mm, clock)
    clock.now += after_s
    report = mm.wake_up(["weights"])
    assert report.copy_path is path and report.bytes_copied > 0
    by_sm = report.bytes_copied if path is CopyPath.SM else 0
    assert (report.bytes_sm, report.bytes_copy_engine) == (by_sm, report.bytes_copied - by_sm)
    assert sum(ran) == by_sm
    assert (report.recent_release_bytes >= 8 * MiB) is (path is CopyPath.SM)
    assert same_bytes(weights, expected)
    assert f"({path.value})" in mm.status().table()
    assert mm.wake_up().copy_path is None  # the KV cache only maps: no copy ran
    del weights
    mm.close()


@pytest.mark.parametrize("mode", ["copy_engine", "hybrid"])
def test_a_forced_mode_is_the_path_the_wake_takes(
    monkeypatch: pytest.MonkeyPatch, clock: Clock, mode: str
) -> None:
    monkeypatch.setenv(ENV_VAR, mode)
    mm = MemoryManager("host")  # the mode from the environment
    weights, expected = sleep_with_large_release(mm, clock)
    report = mm.wake_up(["weights"])
    assert report.copy_path is CopyPath(mode)
    assert (report.bytes_sm > 0) is (mode == "hybrid")
    assert report.bytes_copy_engine + report.bytes_sm == report.bytes_copied
    assert same_bytes(weights, expected)
    del weights
    mm.close()


def test_freeing_an_allocation_is_a_release_too(clock: Clock) -> None:
    mm = MemoryManager("host")
    mm.release_history.clock = clock
    kv = mm.empty((8 * MiB,), torch.uint8, "kv_cache")
    assert mm.release_history.recent_bytes(1.0) == 0
    del kv
    assert mm.release_history.recent_bytes(1.0) == 8 * MiB
    mm.close()


def test_the_sm_copy_reads_memory_it_does_not_own() -> None:
    """sm_copy's views free nothing: the source survives the copy's tensors."""
    buffer = (ctypes.c_uint8 * 64)(*range(64))
    out = torch.zeros(64, dtype=torch.uint8)
    sm_copy(out.data_ptr(), ctypes.addressof(buffer), 64, torch.device("cpu"))
    assert out.tolist() == list(range(64)) and buffer[63] == 63
