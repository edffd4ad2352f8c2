"""A bucket's refit is answered with each rank's weight record (``RefitReport``,
``worker/refit_record.py``): after ``update_weights_from_tensor`` the engine's view of stale
weights is the workers' own, with no second round trip when every rank wrote the bucket, and
asked of every rank when one failed (``engine/refits.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from dormant.core.commands import Command
from dormant.core.errors import RankStateMismatchError
from dormant.core.sleep_state import RankSleepState
from dormant.engine import WeightsNotLoadedError
from dormant.engine.sleep_control import SleepControl
from dormant.memory import TagState
from dormant.worker import copy_plan
from dormant.worker.ipc_weights import FLATTENED_BUCKET, flattened_bucket_request
from dormant.worker.refit_record import RefitReport
from dormant.worker.transfer_errors import WeightTransferError
from tests.engine.conftest import GREEDY, PROMPTS, hf_state_dict, worker_of

on_the_cpu = pytest.mark.parametrize("device", ["cpu"])


def sent_commands(llm: Any, monkeypatch: pytest.MonkeyPatch) -> list[Command]:
    """The commands the engine sends its ranks from now on."""
    executor = llm.llm_engine.executor
    sent: list[Command] = []
    run = executor.run

    def counted(command: Command, *args: Any, **kwargs: Any) -> list[Any]:
        sent.append(command)
        return run(command, *args, **kwargs)

    monkeypatch.setattr(executor, "run", counted)
    return sent


def refit_bucket(llm: Any, named: list) -> None:
    entries, flat = flattened_bucket_request(named)
    llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET)
    del flat  # the sender may drop its buffer once the call returned


@on_the_cpu
def test_each_written_bucket_reports_the_ranks_record_in_one_round_trip(
    make_llm, checkpoint, monkeypatch
) -> None:
    """After a level-2 sleep, two buckets refit every weight: after each, the engine's view is
    exactly what the rank would answer to ``sleep_state`` (its tags, its stale weights, its
    write count), though only the refit command was sent."""
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    worker, control = worker_of(llm), llm.llm_engine.sleep_control
    num_writes = worker.refits.num_writes
    weights = list(hf_state_dict(2).items())
    sent = sent_commands(llm, monkeypatch)
    refit_bucket(llm, weights[:5])
    assert control.stale_weights == frozenset(worker.refits.stale) != frozenset()
    assert control.ranks == (worker.sleep_state(),)
    assert control.ranks[0].num_weight_writes == worker.refits.num_writes == num_writes + 1
    refit_bucket(llm, weights[5:])
    assert control.stale_weights == frozenset() and control.ranks == (worker.sleep_state(),)
    assert control.ranks[0].num_weight_writes == num_writes + 2
    assert dict(control.ranks[0].tags)["kv_cache"] is TagState.DISCARDED  # not woken yet
    assert sent == [Command.UPDATE_WEIGHTS_FROM_TENSOR] * 2
    llm.wake_up(tags=["kv_cache"])
    llm.generate(PROMPTS, GREEDY)  # every weight current: generating is allowed


@on_the_cpu
def test_a_bucket_whose_copy_fails_leaves_every_weight_stale_in_the_engines_view(
    make_llm, checkpoint, monkeypatch
) -> None:
    """A copy that fails marks every weight stale on the rank; the engine asks the rank (the
    failed command reported nothing) and refuses to generate."""
    llm = make_llm(str(checkpoint))
    worker, control = worker_of(llm), llm.llm_engine.sleep_control
    assert control.stale_weights == frozenset()

    def fail(*args: Any) -> None:
        raise RuntimeError("injected: the device copy failed")

    monkeypatch.setattr(copy_plan, "wait_for_copies", fail)
    sent = sent_commands(llm, monkeypatch)
    with pytest.raises(WeightTransferError, match="every weight is marked stale"):
        refit_bucket(llm, list(hf_state_dict(2).items())[:4])
    assert control.stale_weights == worker.refits.names
    assert control.ranks == (worker.sleep_state(),)
    assert sent == [Command.UPDATE_WEIGHTS_FROM_TENSOR, Command.SLEEP_STATE]
    with pytest.raises(WeightsNotLoadedError):
        llm.generate(PROMPTS, GREEDY)


def test_reports_replace_only_the_weight_record_and_ranks_must_agree() -> None:
    tags = (("weights", TagState.AWAKE), ("kv_cache", TagState.DISCARDED))
    rank = RankSleepState(tags, frozenset({"a", "b"}), 2, num_weight_writes=3, num_kv_discards=4)
    control = SleepControl([rank, rank])
    control.level = 2
    control.refitted([RefitReport(("a",), frozenset({"b"}), 4)] * 2)
    assert control.ranks == (RankSleepState(tags, frozenset({"b"}), 2),) * 2
    assert [(r.num_weight_writes, r.num_kv_discards) for r in control.ranks] == [(4, 4)] * 2
    assert control.level == 2  # still asleep: a refit wakes nothing
    with pytest.raises(RankStateMismatchError):
        control.refitted([RefitReport(("b",), frozenset(), 5), RefitReport((), frozenset("b"), 5)])
    assert [r.stale_weights for r in control.ranks] == [frozenset(), frozenset("b")]  # recorded
