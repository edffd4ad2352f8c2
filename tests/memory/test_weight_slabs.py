"""The ``weights`` tag's slab rule (slab_rules.LONG_LIVED): an 8B-like weight set allocated one
tensor at a time sleeps and wakes as a handful of physical handles, not one per matrix; slabs
trim their unused tail once asleep; contents, addresses, unchanged detection and level-2
discard + refit + wake are as under the default rule."""

from __future__ import annotations

import pytest
import torch

from dormant.memory import (
    LONG_LIVED,
    InvalidSlabRuleError,
    MemoryManager,
    SlabRule,
    State,
)
from dormant.memory.host_backend import HostBackend
from tests.memory.faults import FaultyBackend, check_truth
from tests.memory.helpers import random_fill, same_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def weight_mix(scale: int = 1) -> list[int]:
    """Bytes of benchmarks/sleep_wake.py's 8B-like set (2 x 1 GiB + 128 matrices of 40/56 MiB
    + 65 norms of 8 KiB: 131 blocks of at least 32 MiB), divided by ``scale``."""
    sizes = [GiB, GiB] + [(40 if i % 2 else 56) * MiB for i in range(128)] + [8 * KiB] * 65
    return [n // scale for n in sizes]


def handles(mm: MemoryManager, tag: str = "weights") -> int:
    return len(list(mm._table.allocations([tag])))


@pytest.mark.parametrize("rules, most", [(None, 8), ({}, None)])
def test_8b_weights_sleep_and_wake_in_a_handful_of_driver_calls(rules, most) -> None:
    """Real sizes (the host backend's memfds are sparse: nothing here touches a page). Under the
    built-in rule 8 GiB is at most 8 handles, so a sleep makes at most 8 unmaps and 8 releases
    and the wake 8 creates and 8 maps; under the default rule (``slab_rules={}``) it was 131."""
    backend = FaultyBackend(HostBackend())
    mm = MemoryManager(backend, slab_rules=rules)
    tensors = [mm.empty((n,), torch.uint8, "weights") for n in weight_mix()]
    num_handles = handles(mm)
    if most is None:
        assert num_handles >= 131  # every matrix and both embeddings a handle of their own
    else:
        assert num_handles <= most
    slack = mm.status().tag("weights")
    assert slack.block_bytes == sum(-(-n // 256) * 256 for n in weight_mix())
    backend.arm()
    mm.sleep(tags={"weights": "discard"})  # what a level-2 sleep does to the weights
    assert backend.calls["unmap"] == backend.calls["release"] == num_handles
    backend.arm()
    mm.wake_up(["weights"])
    assert backend.calls["create"] == backend.calls["map"] == num_handles
    check_truth(mm, backend)
    del tensors
    mm.close()


def small_mix_manager(backend: HostBackend | FaultyBackend) -> MemoryManager:
    """The 8B-like mix / 1024 (1 MiB embeddings, 40-56 KiB matrices), 16 KiB granules and a
    LONG_LIVED rule scaled down the same way (slabs of up to 2 MiB)."""
    rule = SlabRule(max_slab_bytes=2 * MiB, growth=2, coalesce_fraction=1, trims=True)
    return MemoryManager(backend, slab_bytes=16 * KiB, slab_rules={"weights": rule})


@pytest.fixture
def faulty() -> FaultyBackend:
    return FaultyBackend(HostBackend(granularity=16 * KiB))


def test_coalesced_weights_are_bit_exact_at_their_addresses_and_skip_when_unchanged(
    faulty: FaultyBackend,
) -> None:
    mm = small_mix_manager(faulty)
    tensors = [mm.empty((n,), torch.uint8, "weights") for n in weight_mix(1024)]
    expected = [random_fill(t, seed) for seed, t in enumerate(tensors)]
    addresses = [t.data_ptr() for t in tensors]
    num_handles = handles(mm)
    assert num_handles <= 8

    first = mm.sleep(tags={"weights": "host"})
    assert first.bytes_copied == first.bytes_released  # every slab copied, as it was
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))
    assert [t.data_ptr() for t in tensors] == addresses
    mm.sleep(tags={"weights": "host"})  # copies what the trim re-spanned (its digest went)
    mm.wake_up()
    faulty.arm()
    unchanged = mm.sleep(tags={"weights": "host"})
    assert unchanged.bytes_copied == 0 and unchanged.bytes_skipped == unchanged.bytes_released
    assert faulty.calls["unmap"] == faulty.calls["release"] == num_handles
    assert faulty.calls["copy_batch.add"] == 0
    mm.wake_up()
    tensors[5].view(-1)[0] += 1  # one matrix changes: its slab, and only it, is copied again
    expected[5] = tensors[5].clone()
    changed = mm.sleep(tags={"weights": "host"})
    slab = mm._table.find(tensors[5].data_ptr()).allocation
    assert changed.bytes_copied == slab.size
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, expected, strict=True))
    check_truth(mm, faulty)


def test_level_2_discard_then_refit_then_level_1(faulty: FaultyBackend) -> None:
    mm = small_mix_manager(faulty)
    tensors = [mm.empty((n,), torch.uint8, "weights") for n in weight_mix(1024)]
    for seed, t in enumerate(tensors):
        random_fill(t, seed)
    addresses = [t.data_ptr() for t in tensors]
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    mm.sleep(tags={"weights": "discard"})
    mm.wake_up()
    refit = [random_fill(t, 100 + seed) for seed, t in enumerate(tensors)]  # the refit
    report = mm.sleep(tags={"weights": "host"})
    assert report.bytes_copied == report.bytes_released  # new contents: all copied
    mm.wake_up()
    assert all(same_bytes(t, e) for t, e in zip(tensors, refit, strict=True))
    assert [t.data_ptr() for t in tensors] == addresses
    check_truth(mm, faulty)


def test_a_slab_trims_its_unused_tail_once_asleep(faulty: FaultyBackend) -> None:
    """The last slab's free tail is physical memory only until the first sleep: the wake
    creates the slab up to its last block (rounded to a granule), its VA stays reserved, and a
    later block goes to a new slab, never past the trimmed end."""
    mm = small_mix_manager(faulty)
    tensors = [mm.empty((n,), torch.uint8, "weights") for n in weight_mix(1024)]
    before = mm.status().tag("weights")
    assert before.reserved_bytes - before.block_bytes > 64 * KiB  # the last slab's tail
    mm.sleep(tags={"weights": "host"})
    mm.wake_up()
    after = mm.status().tag("weights")
    assert after.block_bytes == before.block_bytes
    assert after.reserved_bytes - after.block_bytes < handles(mm) * 16 * KiB
    trimmed = [a for a in mm._table.allocations(["weights"]) if a.reserved > a.size]
    assert trimmed and all(a.state is State.MAPPED for a in trimmed)
    reservations = faulty.inner.live_reservations()
    assert all(reservations[a.va] == a.reserved for a in trimmed)
    extra = mm.empty((64 * KiB,), torch.uint8, "weights")
    home = mm._table.find(extra.data_ptr()).allocation
    assert extra.data_ptr() + 64 * KiB <= home.va + home.size
    extra.fill_(7)  # mapped: a write past a trimmed end would segfault
    del tensors, extra
    mm.close()
    assert faulty.inner.live_reservations() == {} and faulty.inner.live_handles() == {}


def test_bad_slab_rules_are_refused() -> None:
    with pytest.raises(InvalidSlabRuleError, match="positive"):
        SlabRule(max_slab_bytes=0)
    with pytest.raises(InvalidSlabRuleError, match="positive"):
        SlabRule(growth=0)
    with pytest.raises(InvalidSlabRuleError, match="must be a SlabRule"):
        MemoryManager("host", slab_rules={"weights": 2 << 30})  # type: ignore[dict-item]
    mm = MemoryManager("host")
    with pytest.raises(InvalidSlabRuleError, match="must be a SlabRule"):
        mm.register_tag("adapter", slab_rule="long")  # type: ignore[arg-type]
    assert "adapter" not in mm.tags
    mm.register_tag("adapter", slab_rule=LONG_LIVED)
    assert mm._table.pools["adapter"].rule is LONG_LIVED
    mm.close()
