"""A weight-update group over gloo: a spawned trainer process (rank 0) broadcasts new weights to
an engine rank in the test process (rank 1)."""

from __future__ import annotations

from typing import Literal

import pytest

from dormant.models import WeightError
from dormant.models import weights as weight_io
from dormant.worker.ipc_weights import FLATTENED_BUCKET
from dormant.worker.transfer_errors import UpdateGroupError, WeightTransferError
from dormant.worker.update_group import WeightUpdateGroups
from tests.worker.group_trainer import (
    GROUP,
    OK,
    Round,
    Trainer,
    assert_state_equal,
    failing_write,
    free_port,
    new_weights,
    record_of,
    reference_state,
    request,
    shapes_of,
    state,
    tiny_model,
)


def test_broadcast_refits_exactly_in_buckets_and_as_one_flat_bucket() -> None:
    model = tiny_model()
    shapes = shapes_of(model)
    record = record_of(model)
    bad_names, bad_dtypes, bad_shapes = request(new_weights(shapes, 1))
    bad_names[3] = "model.layers.0.self_attn.q_prog.weight"
    rounds = [Round(new_weights(shapes, 1)), Round(new_weights(shapes, 2))]
    trainer = Trainer([*rounds, Round(new_weights(shapes, 3), flat=True)])
    groups = WeightUpdateGroups(bucket_bytes=8 << 10, timeout_s=20)  # several buckets
    trainer.join(groups)
    assert groups.names() == (GROUP,)

    # A request that does not fit: refused before any write; its broadcasts are drained.
    before = state(model)
    with pytest.raises(WeightError, match="q_prog"):
        groups.update_weights_from_distributed(model, bad_names, bad_dtypes, bad_shapes, GROUP)
    assert_state_equal(state(model), before)
    assert trainer.outcome() == OK
    trainer.next_round()

    record.discarded()
    written = groups.update_weights_from_distributed(model, *request(new_weights(shapes, 2)), GROUP)
    assert written == set(shapes) and record.stale == set()
    assert_state_equal(state(model), reference_state(shapes, 2))
    assert trainer.outcome() == OK
    trainer.next_round()

    record.discarded()
    groups.update_weights_from_distributed(
        model, *request(new_weights(shapes, 3)), GROUP, load_format=FLATTENED_BUCKET
    )
    assert record.stale == set()
    assert_state_equal(state(model), reference_state(shapes, 3))
    assert trainer.outcome() == OK
    trainer.next_round()

    groups.destroy_weights_update_group(GROUP)
    assert groups.names() == ()
    assert trainer.finish() == 0


@pytest.mark.parametrize("failure", ["die", "hang"])
def test_a_sender_lost_mid_broadcast_marks_every_weight_stale(
    failure: Literal["die", "hang"],
) -> None:
    model = tiny_model()
    shapes = shapes_of(model)
    trainer = Trainer([Round(new_weights(shapes, 0)[:5], after=failure)])
    groups = WeightUpdateGroups(bucket_bytes=1 << 10, timeout_s=3.0)  # bucket: one tensor
    trainer.join(groups)
    # A stalled sender under load may time out before its 5th tensor arrived.
    expected = "after 5 of 25" if failure == "die" else r"after [0-5] of 25"
    with pytest.raises(WeightTransferError, match=expected) as error:
        groups.update_weights_from_distributed(model, *request(new_weights(shapes, 0)), GROUP)
    assert record_of(model).stale == set(shapes)  # the observer was told: failed()
    assert "every weight is marked stale" in str(error.value)
    assert groups.names() == ()  # the broken group is gone; the trainer must create it again
    if failure == "hang":
        assert "timed out" in str(error.value.__cause__).lower()
    trainer.finish(timeout=0 if failure == "hang" else 30)


def test_a_write_failing_then_a_sender_lost_while_the_rest_drains(monkeypatch) -> None:
    """A write fails partway (every weight stale), and the trainer is lost while the rest of
    its broadcast is received: the group is out of step, so it is destroyed; joined again, a
    refit works."""
    model = tiny_model()
    shapes = shapes_of(model)
    sent = new_weights(shapes, 1)
    trainer = Trainer([Round(sent[:12], after="abort"), Round(new_weights(shapes, 2))])
    groups = WeightUpdateGroups(bucket_bytes=1 << 10, timeout_s=20)  # a tensor or a few each
    trainer.join(groups)
    monkeypatch.setattr(weight_io, "load_weights", failing_write(after=3))
    with pytest.raises(WeightTransferError, match="injected: copy 4 failed") as error:
        groups.update_weights_from_distributed(model, *request(sent), GROUP)
    monkeypatch.undo()
    assert "then the broadcast failed after" in str(error.value)
    assert "every weight is marked stale" in str(error.value)
    assert "The group was destroyed" in str(error.value)
    assert record_of(model).stale == set(shapes) and groups.names() == ()
    assert trainer.outcome() == OK  # its 12 broadcasts arrived; then it aborted its side
    trainer.rejoin(groups)
    trainer.next_round()

    groups.update_weights_from_distributed(model, *request(new_weights(shapes, 2)), GROUP)
    assert record_of(model).stale == set() and trainer.outcome() == OK
    assert_state_equal(state(model), reference_state(shapes, 2))
    trainer.next_round()
    groups.destroy_weights_update_group(GROUP)
    assert trainer.finish() == 0


def test_bad_group_calls_raise_and_change_nothing() -> None:
    groups = WeightUpdateGroups(tp_rank=1, timeout_s=1.0)
    with pytest.raises(UpdateGroupError, match="no weight-update group"):
        groups.update_weights_from_distributed(tiny_model(), [], [], [], "missing")
    with pytest.raises(UpdateGroupError, match=r"outside 1\.\.1"):
        groups.init_weights_update_group("127.0.0.1", free_port(), 1, 2, GROUP, "gloo")
    with pytest.raises(UpdateGroupError, match="backend"):
        groups.init_weights_update_group("127.0.0.1", free_port(), 0, 3, GROUP, "mpi")
    assert groups.names() == ()


def test_a_rendezvous_nobody_hosts_times_out() -> None:
    groups = WeightUpdateGroups(timeout_s=1.0)
    with pytest.raises(WeightTransferError, match="could not join"):
        groups.init_weights_update_group("127.0.0.1", free_port(), 1, 2, GROUP, "gloo")
    assert groups.names() == ()
