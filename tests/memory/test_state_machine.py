"""Every transition of the memory state machine (DESIGN §2.3)."""

from __future__ import annotations

import gc

import pytest
import torch

from dormant.memory import (
    MemoryManager,
    Policy,
    SleepConflictError,
    TagAsleepError,
    TagState,
    UnknownPolicyError,
    UnknownTagError,
)
from dormant.memory.allocation import State
from tests.memory.helpers import random_fill, same_bytes


def states(mm: MemoryManager) -> dict[str, tuple[str, int, int]]:
    """Everything observable about each tag's state."""
    return {t.tag: (t.state, t.mapped_bytes, t.host_bytes) for t in mm.status().tags}


def test_level_presets(mm: MemoryManager) -> None:
    w = mm.empty((1024, 1024), torch.float32, "weights")
    kv = mm.empty((1024, 1024), torch.float32, "kv_cache")
    table = mm.empty((64,), torch.int32, "runtime")
    mm.sleep(level=1)
    assert mm.asleep_tags["weights"] is Policy.HOST
    assert mm.asleep_tags["kv_cache"] is Policy.DISCARD
    assert mm.asleep_tags["runtime"] is Policy.HOST
    mm.wake_up()
    mm.sleep(level=2)
    assert mm.asleep_tags["weights"] is Policy.DISCARD
    assert mm.asleep_tags["runtime"] is Policy.HOST
    mm.wake_up()
    assert not mm.is_sleeping()
    del w, kv, table


def test_empty_tags_are_awake(mm: MemoryManager) -> None:
    """A tag with no allocations has nothing to sleep: it stays AWAKE, and can be allocated in."""
    w = mm.empty((4096,), torch.float32, "weights")
    report = mm.sleep(level=1)
    assert report.tags == {"weights": Policy.HOST}
    assert mm.tag_states() == {
        "weights": TagState.OFFLOADED,
        "kv_cache": TagState.AWAKE,
        "runtime": TagState.AWAKE,
        "cuda_graph": TagState.AWAKE,
        "workspace": TagState.AWAKE,
    }
    assert mm.asleep_tags == {"weights": Policy.HOST}
    assert not mm.is_sleeping("kv_cache") and mm.is_sleeping("weights") and mm.is_sleeping()
    with pytest.raises(UnknownTagError):
        mm.is_sleeping("weight")
    kv = mm.empty((16,), torch.float32, "kv_cache")
    mm.wake_up()
    assert set(mm.tag_states().values()) == {TagState.AWAKE} and not mm.is_sleeping()
    del w, kv


def test_level_zero_changes_nothing(mm: MemoryManager) -> None:
    w = mm.empty((100,), torch.float32, "weights")
    before = states(mm)
    report = mm.sleep(level=0)
    assert report.tags == {} and states(mm) == before and not mm.is_sleeping()
    del w


def test_sleeping_again_with_same_policy_is_a_noop(mm: MemoryManager) -> None:
    w = mm.empty((4096,), torch.float32, "weights")
    mm.sleep(level=1)
    before = states(mm)
    report = mm.sleep(level=1)
    assert report.tags == {} and report.bytes_copied == 0
    assert states(mm) == before
    mm.sleep(tags={"weights": "host"})
    assert states(mm) == before
    mm.wake_up()
    del w


def test_waking_an_awake_tag_is_a_noop(mm: MemoryManager) -> None:
    w = mm.empty((4096,), torch.float32, "weights")
    expected = random_fill(w, 1)
    report = mm.wake_up(["weights"])
    assert report.tags == () and report.bytes_mapped == 0
    mm.sleep(level=1)
    mm.wake_up()
    assert mm.wake_up().tags == ()
    assert same_bytes(w, expected)


def test_sleeping_with_a_different_policy_raises_and_changes_nothing(mm: MemoryManager) -> None:
    w = mm.empty((4096,), torch.float32, "weights")
    expected = random_fill(w, 2)
    mm.sleep(level=1)
    before = states(mm)
    with pytest.raises(SleepConflictError, match=r"weights.*HOST.*DISCARD"):
        mm.sleep(level=2)
    with pytest.raises(SleepConflictError):
        mm.sleep(tags={"weights": Policy.DISCARD})
    assert states(mm) == before
    mm.wake_up()
    assert same_bytes(w, expected)


def test_conflict_in_one_tag_changes_no_other_tag(mm: MemoryManager) -> None:
    live = [mm.empty((4096,), torch.float32, tag) for tag in ("weights", "kv_cache")]
    mm.sleep(tags={"weights": "host"})
    before = states(mm)
    with pytest.raises(SleepConflictError):
        mm.sleep(tags={"kv_cache": "discard", "weights": "discard"})
    assert states(mm) == before and not mm.is_sleeping("kv_cache")
    del live


def test_unknown_tag_raises_and_changes_nothing(mm: MemoryManager) -> None:
    mm.empty((4096,), torch.float32, "weights")
    before = states(mm)
    with pytest.raises(UnknownTagError, match="kv_cahce"):
        mm.sleep(tags={"weights": "host", "kv_cahce": "discard"})
    with pytest.raises(UnknownTagError):
        mm.wake_up(["weights", "nope"])
    with pytest.raises(UnknownTagError):
        mm.empty((4,), torch.float32, "nope")
    assert states(mm) == before and not mm.is_sleeping()


def test_unknown_policy_raises_and_changes_nothing(mm: MemoryManager) -> None:
    mm.empty((4096,), torch.float32, "weights")
    before = states(mm)
    with pytest.raises(UnknownPolicyError, match="evaporate"):
        mm.sleep(tags={"weights": "evaporate"})
    with pytest.raises(UnknownPolicyError):
        mm.sleep(tags={"weights": 3})  # type: ignore[dict-item]
    assert states(mm) == before


def test_unknown_level_and_bad_arguments(mm: MemoryManager) -> None:
    with pytest.raises(ValueError, match="level"):
        mm.sleep(level=3)
    with pytest.raises(TypeError):
        mm.sleep()
    with pytest.raises(TypeError):
        mm.sleep(level=1, tags={"weights": "host"})
    assert not mm.is_sleeping()


def test_allocating_in_a_sleeping_tag_raises(mm: MemoryManager) -> None:
    kv = mm.empty((16,), torch.float32, "kv_cache")
    mm.sleep(tags={"kv_cache": "discard"})
    with pytest.raises(TagAsleepError, match=r"kv_cache.*discarded"):
        mm.empty((16,), torch.float32, "kv_cache")
    with pytest.raises(TagAsleepError):
        mm.raw_alloc(64, "kv_cache")
    assert mm.status().tag("kv_cache").num_allocations == 1
    mm.wake_up("kv_cache")
    assert mm.empty((16,), torch.float32, "kv_cache").numel() == 16
    del kv


def test_selective_wake_leaves_other_tags_asleep(mm: MemoryManager) -> None:
    w = mm.empty((1 << 16,), torch.float32, "weights")
    expected = random_fill(w, 3)
    kv = mm.empty((1 << 16,), torch.float32, "kv_cache")
    table = mm.empty((64,), torch.int32, "runtime")
    mm.sleep(level=1)
    mm.wake_up(["weights"])
    assert mm.is_sleeping("kv_cache") and not mm.is_sleeping("weights")
    assert same_bytes(w, expected)
    assert mm.status().tag("kv_cache").mapped_bytes == 0
    mm.wake_up("kv_cache")
    assert mm.is_sleeping("runtime")  # level 1 put it to sleep too; nobody woke it yet
    mm.wake_up()
    assert not mm.is_sleeping()
    del kv, table


@pytest.mark.parametrize("policy", [Policy.HOST, Policy.DISCARD])
@pytest.mark.parametrize("size", [100, 3 << 20])  # a slab block, and an allocation of its own
def test_freeing_while_asleep_frees_va_and_host_copy_once(
    make_mm, policy: Policy, size: int
) -> None:
    mm = make_mm()
    t = mm.empty((size,), torch.uint8, "weights")
    t.fill_(1)
    mm.sleep(tags={"weights": policy})
    assert mm.status().tag("weights").num_allocations == 1
    del t
    gc.collect()
    status = mm.status().tag("weights")
    assert status.num_allocations == 0 and status.host_bytes == 0
    assert mm.arena.used_bytes == 0
    mm.wake_up()  # nothing left to map: must not touch the freed allocation
    assert mm.status().tag("weights").num_allocations == 0


def test_free_while_awake_returns_physical_memory(mm: MemoryManager) -> None:
    used = mm.status().device_used_bytes
    t = mm.empty((8 << 20,), torch.uint8, "workspace")
    assert mm.status().device_used_bytes >= used + (8 << 20)
    view = t[10:20]
    del t
    gc.collect()
    assert mm.status().tag("workspace").num_allocations == 1  # a view keeps the storage alive
    del view
    gc.collect()
    assert mm.status().tag("workspace").num_allocations == 0
    assert mm.status().device_used_bytes <= used


def test_user_tags(mm: MemoryManager) -> None:
    mm.register_tag("draft_weights")
    mm.register_tag("scratch", levels={1: "discard", 2: "discard"})
    d = mm.empty((4096,), torch.float32, "draft_weights")
    expected = random_fill(d, 4)
    scratch = mm.empty((4096,), torch.float32, "scratch")
    mm.sleep(level=2)
    assert mm.asleep_tags["draft_weights"] is Policy.HOST  # user tags are preserved by default
    assert mm.asleep_tags["scratch"] is Policy.DISCARD
    mm.wake_up()
    assert same_bytes(d, expected)
    del scratch
    with pytest.raises(ValueError, match="already exists"):
        mm.register_tag("weights")
    with pytest.raises(UnknownPolicyError):
        mm.register_tag("bad", levels={1: "nope"})
    assert "bad" not in mm.tags


def test_allocation_states_follow_their_tag(mm: MemoryManager) -> None:
    live = [mm.empty((3 << 20,), torch.uint8, tag) for tag in ("weights", "kv_cache")]
    mm.sleep(level=1)
    by_tag = {a.tag: a.state for a in mm._table.allocations()}
    assert by_tag == {"weights": State.OFFLOADED, "kv_cache": State.DISCARDED}
    mm.wake_up()
    assert {a.state for a in mm._table.allocations()} == {State.MAPPED}
    del live


def test_closed_manager_refuses_operations(make_mm) -> None:
    mm = make_mm()
    t = mm.empty((16,), torch.float32, "weights")
    mm.close()
    with pytest.raises(Exception, match="closed"):
        mm.sleep(level=1)
    assert not mm.is_sleeping() and mm.tag_states()["weights"] is TagState.AWAKE  # readable
    t.fill_(1.0)  # live tensors stay valid after close
    assert float(t.sum()) == 16.0
