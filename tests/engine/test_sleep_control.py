"""The engine's sleep control plane (issue #11): one typed state, vLLM's semantics, failures the
engine recovers from, and refits tracked by the workers whatever path wrote them."""

from __future__ import annotations

import pytest

from dormant.core.commands import PUBLIC_RPC
from dormant.core.errors import RankStateMismatchError
from dormant.core.sleep_state import RankSleepState
from dormant.engine import EngineAsleepError, SleepLevelConflictError, WeightsNotLoadedError
from dormant.engine.sleep_control import SleepControl
from dormant.memory import DriverError, TagState
from tests.engine.conftest import GREEDY, PROMPTS, hf_state_dict, tokens, worker_of


def tag_states(llm) -> dict[str, TagState]:
    return dict(llm.llm_engine.sleep_control.ranks[0].tags)


def test_wake_up_returns_whether_the_engine_is_fully_awake(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    llm.sleep(level=1)
    assert llm.wake_up(["weights"]) is False
    assert llm.wake_up(["kv_cache"]) is True
    assert llm.wake_up() is True  # waking an awake engine is a no-op


def test_pause_then_release_then_sleep_deeper(make_llm, checkpoint) -> None:
    """vLLM's pause-then-release flow: sleep(0), a KV-only release, then sleep(2) are all
    legal; after the RL wake sequence the tokens are the ones from before."""
    llm = make_llm(str(checkpoint))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(level=0)
    assert llm.is_sleeping()
    with pytest.raises(EngineAsleepError, match="paused"):
        llm.generate(PROMPTS, GREEDY)
    llm.release_memory_occupation(["kv_cache"])
    assert tag_states(llm)["kv_cache"] is TagState.DISCARDED
    llm.sleep(level=2)  # the KV cache is discarded either way: no conflict
    assert tag_states(llm)["weights"] is TagState.DISCARDED
    assert llm.wake_up(["weights"]) is False
    llm.collective_rpc("reload_weights")
    assert llm.wake_up(["kv_cache"]) is True
    assert not llm.is_sleeping()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


def test_conflicts_are_per_tag(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    llm.generate(PROMPTS, GREEDY)
    llm.sleep(level=1)
    llm.sleep(level=1)  # the same again: a no-op
    states = tag_states(llm)
    with pytest.raises(SleepLevelConflictError, match="'weights' is offloaded"):
        llm.sleep(level=2)  # offloaded weights cannot be discarded without a wake
    assert tag_states(llm) == states
    llm.wake_up()
    llm.sleep(level=2)
    with pytest.raises(SleepLevelConflictError, match="'weights' is discarded"):
        llm.sleep(level=1)  # nor discarded ones offloaded
    llm.wake_up()
    llm.reload_weights()


def test_a_conflicting_sleep_aborts_no_request(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    llm.sleep(level=1)
    engine = llm.llm_engine
    engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(SleepLevelConflictError):
        engine.sleep(level=2, mode="abort")
    assert engine.has_unfinished_requests()  # refused before the request was touched
    llm.wake_up()
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("device", ["cpu"])
def test_collective_rpc_returns_one_result_per_rank_for_every_method(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    calls = {
        "sleep": (1,),
        "wake_up": (),
        "sleep_state": (),
        "reload_weights": (),
        "update_weights": (list(hf_state_dict(1).items())[:2],),
        "memory_status": (),
        "kv_cache_scales": (),
        "audit": (),
        "verify_guards": (),
        "check_health": (),
    }
    assert set(calls) == set(PUBLIC_RPC)  # a new RPC gets a case here
    for method, args in calls.items():
        results = llm.collective_rpc(method, args=list(args))
        assert isinstance(results, list) and len(results) == 1, method
    assert isinstance(llm.collective_rpc("sleep", args=[1])[0], RankSleepState)
    assert llm.collective_rpc("wake_up")[0].asleep_tags == ()


@pytest.mark.parametrize("device", ["cpu"])
def test_a_failed_release_during_sleep_is_recoverable(make_llm, checkpoint) -> None:
    """The issue's bug, through the engine: release fails on its second call during sleep(1).
    The engine says what is asleep, refuses to generate, and the next wake restores every
    byte, so the tokens are the ones from before."""
    llm = make_llm(str(checkpoint))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    backend = worker_of(llm).mm.backend
    real_release, calls = backend.release, []

    def failing_release(handle: object) -> None:
        calls.append(handle)
        if len(calls) == 2:
            raise DriverError("injected: release failed")
        real_release(handle)

    backend.release = failing_release
    with pytest.raises(DriverError, match="injected"):
        llm.sleep(level=1)
    backend.release = real_release
    assert llm.is_sleeping()  # the engine's view comes from the workers, failure or not
    assert llm.llm_engine.sleep_control.asleep_tags
    with pytest.raises(EngineAsleepError):
        llm.generate(PROMPTS, GREEDY)
    assert llm.wake_up() is True
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before
    llm.sleep(level=1)  # and the next sleep completes
    assert llm.wake_up() is True


@pytest.mark.parametrize("device", ["cpu"])
def test_a_refit_through_the_model_object_is_seen(make_llm, checkpoint, other_checkpoint) -> None:
    """TRL writes through the model object, one fp32 tensor at a time; the worker records it,
    so generate works after a level-2 sleep once every weight was written."""
    reference = make_llm(str(other_checkpoint))
    expected = tokens(reference.generate(PROMPTS, GREEDY))
    reference.shutdown()
    llm = make_llm(str(checkpoint))
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    model = worker_of(llm).model
    new = hf_state_dict(2)
    for name, tensor in new.items():
        model.load_weights([(name, tensor)])
    llm.wake_up(["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected


@pytest.mark.parametrize("device", ["cpu"])
def test_a_refit_that_fails_partway_leaves_the_weights_stale(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    items = list(hf_state_dict(2).items())

    def dies_midway():
        yield from items[:3]
        raise ConnectionError("injected: the sender died")

    with pytest.raises(ConnectionError):
        worker_of(llm).model.load_weights(dies_midway())
    with pytest.raises(WeightsNotLoadedError, match="failed partway"):
        llm.generate(PROMPTS, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.update_weights(hf_state_dict(1))  # a complete refit (back to the checkpoint's values)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


def test_reading_runtime_memory_while_asleep_is_refused(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    llm.sleep(level=1)
    with pytest.raises(EngineAsleepError, match="runtime"):
        llm.collective_rpc("kv_cache_scales")
    llm.wake_up()
    assert len(llm.collective_rpc("kv_cache_scales")[0]) == 2


def test_ranks_that_disagree_are_named() -> None:
    awake = RankSleepState((("weights", TagState.AWAKE),), frozenset(), 1)
    asleep = RankSleepState((("weights", TagState.DISCARDED),), frozenset({"w"}), 1)
    control = SleepControl([awake])
    with pytest.raises(RankStateMismatchError, match=r"ranks \[1\]"):
        control.update([awake, asleep])
    assert control.asleep_tags == ("weights",)  # recorded anyway: the view stays truthful
    assert control.stale_weights == {"w"}


def test_an_empty_release_puts_nothing_to_sleep(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    llm.release_memory_occupation([])
    assert not llm.is_sleeping()
    assert len(llm.generate(PROMPTS, GREEDY)) == len(PROMPTS)
