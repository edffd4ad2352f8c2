"""Every refusal and failure of ``update_weights_from_distributed`` while the trainer broadcasts
beside the call, as slime does: the trainer's broadcast ends (it is received, or fails because
the engine destroyed the group), the weights are bit-exact what the table in ``update_group.py``
says, the error says what happened and what to do, and the next refit works: over the same
group where it is in step, after joining again where it was destroyed. Gloo, with the trainer in
a spawned process (``group_trainer.py``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from dormant.core.errors import EngineAsleepError
from dormant.models import WeightError
from dormant.models import weights as weight_io
from dormant.worker.group_broadcasts import Broadcasts
from dormant.worker.ipc_weights import FLATTENED_BUCKET
from dormant.worker.transfer_errors import (
    UpdateGroupDestroyedError,
    UpdateGroupError,
    WeightTransferError,
)
from dormant.worker.update_group import WeightUpdateGroups
from tests.worker.group_trainer import (
    GROUP,
    OK,
    Round,
    Trainer,
    Weights,
    assert_state_equal,
    failing_write,
    new_weights,
    record_of,
    reference_state,
    request,
    shapes_of,
    state,
    tiny_model,
)

IN_STEP = f"weight-update group '{GROUP}' is in step"


@pytest.fixture
def make_groups() -> Iterator[Callable[..., WeightUpdateGroups]]:
    """``WeightUpdateGroups`` destroyed at the end, failed or not: a group left registered would
    keep its name taken in this process."""
    made: list[WeightUpdateGroups] = []

    def make(**options: Any) -> WeightUpdateGroups:
        made.append(WeightUpdateGroups(**options))
        return made[-1]

    yield make
    for groups in made:
        groups.destroy_all()


def assert_freed(outcome: str) -> None:
    """The trainer's broadcast failed because the engine's side closed, before the trainer's
    own timeout: the destroyed group was freed, not kept open by a reference."""
    assert outcome != OK and "timed out" not in outcome.lower(), outcome


def asleep() -> None:
    raise EngineAsleepError("update_weights_from_distributed needs ['weights'] awake")


def awake() -> None:
    pass


def broken_check() -> None:
    raise KeyError("a check that broke")  # not one of the engine's errors: kept, with a note


def with_tensor(weights: Weights, index: int, tensor: Tensor) -> Weights:
    return [(n, tensor if i == index else t) for i, (n, t) in enumerate(weights)]


@pytest.mark.parametrize("load_format", [None, FLATTENED_BUCKET])
def test_refusals_before_any_write_drain_the_broadcasts(
    make_groups: Callable[..., WeightUpdateGroups], load_format: str | None
) -> None:
    model = tiny_model()
    shapes = shapes_of(model)
    sent = new_weights(shapes, 1)
    names = list(shapes)
    wrong_shape = with_tensor(sent, 2, torch.zeros(3, 5))
    int_weight = with_tensor(sent, 4, torch.zeros(shapes[names[4]], dtype=torch.int32))
    unknown_name = request(sent)
    unknown_name[0][3] = "model.layers.0.self_attn.q_prog.weight"
    not_a_name = request(sent)
    not_a_name[0][0] = 7
    refusals: list[tuple[Weights, tuple, Callable[[], None], type[Exception], str]] = [
        (sent, request(sent), asleep, EngineAsleepError, "awake"),
        (sent, unknown_name, awake, WeightError, "q_prog"),
        (wrong_shape, request(wrong_shape), awake, WeightError, names[2]),
        (int_weight, request(int_weight), awake, WeightError, "int32"),
        (sent, not_a_name, awake, UpdateGroupError, r"names\[0\] = 7"),
        (sent, request(sent), broken_check, KeyError, "a check that broke"),
    ]
    is_flat = load_format == FLATTENED_BUCKET
    rounds = [Round(weights, flat=is_flat) for weights, *_ in refusals]
    trainer = Trainer([*rounds, Round(new_weights(shapes, 2), flat=is_flat)])
    groups = make_groups(bucket_bytes=8 << 10, timeout_s=20)  # several buckets
    trainer.join(groups)
    record = record_of(model)
    before, num_writes = state(model), record.num_writes

    for _, lists, check_writable, error_type, match in refusals:
        with pytest.raises(error_type, match=match) as error:
            groups.update_weights_from_distributed(
                model, *lists, GROUP, load_format=load_format, check_writable=check_writable
            )
        message = "\n".join([str(error.value), *getattr(error.value, "__notes__", [])])
        assert IN_STEP in message and "No weight was written" in message
        assert trainer.outcome() == OK  # every broadcast of the request was received
        assert_state_equal(state(model), before)
        assert (record.stale, record.num_writes) == (set(), num_writes)
        assert groups.names() == (GROUP,)
        trainer.next_round()

    record.discarded()
    groups.update_weights_from_distributed(
        model, *request(new_weights(shapes, 2)), GROUP, load_format=load_format
    )
    assert record.stale == set() and trainer.outcome() == OK
    assert_state_equal(state(model), reference_state(shapes, 2))
    trainer.next_round()
    assert trainer.finish() == 0


def test_requests_that_do_not_say_what_arrives_destroy_the_group(
    make_groups: Callable[..., WeightUpdateGroups],
) -> None:
    """Lists or a format from which the engine cannot tell what the trainer broadcasts: nothing
    is received and the group is destroyed, so the trainer's broadcast fails, not hangs."""
    model = tiny_model()
    shapes = shapes_of(model)
    sent = new_weights(shapes, 1)
    names, dtypes, shapes_sent = request(sent)
    unreadable: list[tuple[tuple, str | None, str]] = [
        ((names, dtypes, shapes_sent), "bogus", "load_format='bogus'"),
        ((names, dtypes[:-1], shapes_sent), None, "differ in length"),
        ((names, ["bfloat17", *dtypes[1:]], shapes_sent), None, r"dtypes\[0\] = 'bfloat17'"),
        ((names, dtypes, [shapes_sent[0], [-1, 32], *shapes_sent[2:]]), None, r"shapes\[1\]"),
        ((names, dtypes, [[2.5], *shapes_sent[1:]]), None, r"shapes\[0\] = \[2\.5\]"),
    ]
    trainer = Trainer([*(Round(sent) for _ in unreadable), Round(new_weights(shapes, 2))])
    groups = make_groups(timeout_s=20)
    trainer.join(groups)
    record = record_of(model)
    before, num_writes = state(model), record.num_writes

    for i, (lists, load_format, match) in enumerate(unreadable):
        with pytest.raises(UpdateGroupDestroyedError, match=match) as error:
            groups.update_weights_from_distributed(model, *lists, GROUP, load_format=load_format)
        assert isinstance(error.value, UpdateGroupError)  # a 400: the request was bad
        assert f"destroyed weight-update group '{GROUP}'" in str(error.value)
        assert "init_weights_update_group" in str(error.value)
        assert_freed(trainer.outcome())
        assert_state_equal(state(model), before)
        assert (record.stale, record.num_writes) == (set(), num_writes)
        assert groups.names() == ()
        with pytest.raises(UpdateGroupError, match=r"was destroyed \(a request it could not read"):
            groups.update_weights_from_distributed(model, *request(sent), GROUP)
        if i == 0:  # destroying a group the engine destroyed is a no-op, once
            groups.destroy_weights_update_group(GROUP)
            with pytest.raises(UpdateGroupError, match="no weight-update group"):
                groups.destroy_weights_update_group(GROUP)
        trainer.rejoin(groups)
        trainer.next_round()

    groups.update_weights_from_distributed(model, *request(new_weights(shapes, 2)), GROUP)
    assert trainer.outcome() == OK
    assert_state_equal(state(model), reference_state(shapes, 2))
    trainer.next_round()
    assert trainer.finish() == 0


def test_a_write_failing_midway_leaves_every_weight_stale_and_the_group_in_step(
    make_groups: Callable[..., WeightUpdateGroups], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model()
    shapes = shapes_of(model)
    trainer = Trainer([Round(new_weights(shapes, 1)), Round(new_weights(shapes, 2))])
    groups = make_groups(bucket_bytes=1 << 10, timeout_s=20)  # a tensor or a few each
    trainer.join(groups)
    record = record_of(model)
    before = state(model)

    monkeypatch.setattr(weight_io, "load_weights", failing_write(after=5))
    with pytest.raises(WeightTransferError, match="injected: copy 6 failed") as error:
        groups.update_weights_from_distributed(model, *request(new_weights(shapes, 1)), GROUP)
    monkeypatch.undo()
    assert "every weight is marked stale" in str(error.value)
    assert "the group is in step: send every weight again" in str(error.value)
    assert record.stale == set(shapes)  # the engine refuses to generate on mixed weights
    assert not torch.equal(state(model)[next(iter(before))], next(iter(before.values())))
    assert trainer.outcome() == OK  # the rest was received and dropped
    assert groups.names() == (GROUP,)
    trainer.next_round()

    groups.update_weights_from_distributed(model, *request(new_weights(shapes, 2)), GROUP)
    assert record.stale == set() and trainer.outcome() == OK
    assert_state_equal(state(model), reference_state(shapes, 2))
    trainer.next_round()
    assert trainer.finish() == 0


def test_a_refused_request_whose_broadcast_fails_writes_nothing(
    make_groups: Callable[..., WeightUpdateGroups],
) -> None:
    """The drain of a refused request loses the trainer: nothing was written, so nothing is
    marked stale, and the error says so; the group is destroyed."""
    model = tiny_model()
    shapes = shapes_of(model)
    sent = new_weights(shapes, 1)
    trainer = Trainer([Round(sent[:5], after="abort"), Round(new_weights(shapes, 2))])
    groups = make_groups(bucket_bytes=1 << 10, timeout_s=20)
    trainer.join(groups)
    record = record_of(model)
    before, num_writes = state(model), record.num_writes

    with pytest.raises(WeightTransferError, match="No weight was written") as error:
        groups.update_weights_from_distributed(model, *request(sent), GROUP, check_writable=asleep)
    message = str(error.value)
    assert "refused (EngineAsleepError" in message and "stale" not in message
    assert "The group was destroyed" in message and "init_weights_update_group" in message
    assert (record.stale, record.num_writes) == (set(), num_writes)
    assert_state_equal(state(model), before)
    assert trainer.outcome() == OK and groups.names() == ()
    trainer.rejoin(groups)
    trainer.next_round()

    groups.update_weights_from_distributed(model, *request(new_weights(shapes, 2)), GROUP)
    assert trainer.outcome() == OK
    assert_state_equal(state(model), reference_state(shapes, 2))
    trainer.next_round()
    assert trainer.finish() == 0


def test_a_refit_that_cannot_receive_destroys_the_group_and_marks_every_weight_stale(
    make_groups: Callable[..., WeightUpdateGroups], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer lost mid-refit, and receive buffers that cannot be allocated (out of memory):
    the group is out of step, so it is destroyed; joined again, a refit works."""
    model, other = tiny_model(), tiny_model()
    shapes = shapes_of(model)
    sent = new_weights(shapes, 1)
    allocate = Broadcasts._allocate
    calls = itertools.count()

    def out_of_memory_at_the_third(self: Broadcasts, *args: object) -> list[Tensor]:
        if next(calls) == 2:
            raise RuntimeError("injected: out of memory")
        return allocate(self, *args)

    rounds = [Round(sent[:5], after="abort"), Round(sent), Round(new_weights(shapes, 2))]
    trainer = Trainer(rounds)
    groups = make_groups(bucket_bytes=8 << 10, timeout_s=20)  # several buckets
    trainer.join(groups)

    with pytest.raises(WeightTransferError, match=r"failed after [0-5] of 25 tensors") as error:
        groups.update_weights_from_distributed(model, *request(sent), GROUP)
    assert "every weight is marked stale" in str(error.value)
    assert "The group was destroyed" in str(error.value)
    assert record_of(model).stale == set(shapes) and groups.names() == ()
    assert trainer.outcome() == OK  # its 5 broadcasts arrived; then it aborted its side
    trainer.rejoin(groups)
    trainer.next_round()

    monkeypatch.setattr(Broadcasts, "_allocate", out_of_memory_at_the_third)
    with pytest.raises(WeightTransferError, match="injected: out of memory") as error:
        groups.update_weights_from_distributed(other, *request(sent), GROUP)
    monkeypatch.undo()
    assert "every weight is marked stale" in str(error.value)
    assert "The group was destroyed" in str(error.value)
    assert record_of(other).stale == set(shapes) and groups.names() == ()
    assert_freed(trainer.outcome())
    trainer.rejoin(groups)
    trainer.next_round()

    groups.update_weights_from_distributed(model, *request(new_weights(shapes, 2)), GROUP)
    assert record_of(model).stale == set() and trainer.outcome() == OK
    assert_state_equal(state(model), reference_state(shapes, 2))
    trainer.next_round()
    assert trainer.finish() == 0
