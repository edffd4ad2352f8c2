"""The receiver's per-bucket lookups when a trainer sends the same buckets every refit: the layout
``bucket_items`` keeps per metadata (by value, never by identity), and the plan's validity check
(``CopyPlan.is_valid_for``), which must see every change of where a destination lives."""

from __future__ import annotations

import copy

import pytest
import torch

from dormant.worker.copy_plan import BucketItem, BucketLayout
from dormant.worker.copy_plans import CopyPlans
from dormant.worker.ipc_weights import bucket_items, make_flattened_bucket
from dormant.worker.transfer_errors import WeightTransferError
from tests.worker.test_copy_plan import (
    TINY_LLAMA,
    assert_state_equal,
    expected_state,
    new_weights,
    refit,
    state,
    tiny,
)


def payload_of(named: list) -> dict:
    flat, metadata = make_flattened_bucket(named)
    return {"flattened_tensor": flat, "metadata": metadata}


def assert_refit_rebuilds(plans: CopyPlans, model, seed: int) -> None:
    """The next refit builds its plan again (the kept one is no longer valid) and writes right."""
    named = new_weights(model, seed)
    refit(plans, model, named)
    assert plans.num_built == 2
    assert_state_equal(state(model), expected_state(TINY_LLAMA, named))


def test_equal_metadata_gives_the_same_layout_object() -> None:
    model = tiny(TINY_LLAMA)
    first, second = payload_of(new_weights(model, 1)), payload_of(new_weights(model, 2))
    assert first["metadata"] is not second["metadata"]  # new objects, as each unpickling makes
    layout = bucket_items(first)[1]
    assert isinstance(layout, BucketLayout) and bucket_items(second)[1] is layout
    assert all(isinstance(item, BucketItem) for item in layout)


@pytest.mark.parametrize("field", ["name", "shape", "dtype", "start_idx", "end_idx", "numel"])
def test_a_changed_field_gives_another_layout(field: str) -> None:
    model = tiny(TINY_LLAMA)
    named = new_weights(model, 3)[:2]
    payload = payload_of(named)
    layout = bucket_items(payload)[1]
    changed = copy.deepcopy(payload)
    meta = changed["metadata"][0]
    if field == "name":
        meta.name = named[1][0]
    elif field == "shape":
        meta.shape = torch.Size(reversed(meta.shape))
    elif field == "dtype":
        meta.dtype = torch.int32  # same itemsize: the slice still holds it
    else:  # one element fewer: the slice no longer holds the tensor
        setattr(meta, field, getattr(meta, field) + (4 if field == "start_idx" else -4))
    if field in ("start_idx", "end_idx", "numel"):
        with pytest.raises(WeightTransferError, match=named[0][0]):
            bucket_items(changed)
        return
    other = bucket_items(changed)[1]
    assert other is not layout and other != layout
    assert bucket_items(payload)[1] is layout  # the first is still kept


def test_a_kept_layout_is_still_checked_against_its_buffer() -> None:
    model = tiny(TINY_LLAMA)
    payload = payload_of(new_weights(model, 4))
    bucket_items(payload)  # kept
    shorter = {**payload, "flattened_tensor": payload["flattened_tensor"][:-4]}
    with pytest.raises(WeightTransferError, match=r"lm_head\.weight"):
        bucket_items(shorter)


def test_dict_or_unhashable_metadata_is_not_kept_but_still_read() -> None:
    model = tiny(TINY_LLAMA)
    payload = payload_of(new_weights(model, 5)[:3])
    expected = bucket_items(payload)[1]
    as_dicts = {**payload, "metadata": [vars(m).copy() for m in payload["metadata"]]}
    assert bucket_items(as_dicts)[1] == expected
    listed = copy.deepcopy(payload)
    listed["metadata"][0].shape = list(listed["metadata"][0].shape)  # unhashable
    assert bucket_items(listed)[1] == expected and bucket_items(listed)[1] is not expected


def test_the_plan_is_found_by_the_layout_across_refits() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    for seed in range(3):
        named = new_weights(model, 10 + seed)
        refit(plans, model, named)
        assert_state_equal(state(model), expected_state(TINY_LLAMA, named))
    assert plans.num_built == 1


# ── the validity check: every move of a destination is seen ───────────────────────────────


def _same_shape_pair(model) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    layers = model.model.layers
    return layers[0].self_attn.o_proj.weight, layers[1].self_attn.o_proj.weight


def test_two_parameters_swapped_within_their_storage_rebuild_the_plan() -> None:
    """Both stay in the pool's one storage (its address unchanged): only their places moved."""
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    refit(plans, model, new_weights(model, 20))
    first, second = _same_shape_pair(model)
    storage = first.untyped_storage().data_ptr()
    first.data, second.data = second.data, first.data
    assert first.untyped_storage().data_ptr() == storage
    assert_refit_rebuilds(plans, model, seed=21)


def test_a_parameter_moved_to_another_storage_rebuilds_the_plan() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    refit(plans, model, new_weights(model, 22))
    weight = model.model.layers[1].mlp.down_proj.weight
    weight.data = weight.data.clone()  # same values, its own storage
    assert_refit_rebuilds(plans, model, seed=23)


def test_a_parameter_set_to_another_offset_of_its_storage_rebuilds_the_plan() -> None:
    """Same storage, same shape, another offset (``set_``): the data address moved."""
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    refit(plans, model, new_weights(model, 24))
    first, second = _same_shape_pair(model)
    spare = torch.empty_like(second.data)
    spare.copy_(second.data)
    with torch.no_grad():
        second.set_(first.untyped_storage(), first.storage_offset(), first.shape, first.stride())
        first.set_(spare)  # first moved out, second took its place
    assert_refit_rebuilds(plans, model, seed=25)


def test_a_model_adopted_again_rebuilds_the_plan() -> None:
    from dormant.memory import MemoryManager

    model, plans = tiny(TINY_LLAMA), CopyPlans()
    refit(plans, model, new_weights(model, 26))
    MemoryManager("host").adopt(model)  # every parameter into a new pool block
    assert_refit_rebuilds(plans, model, seed=27)


def test_the_kept_layouts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from dormant.worker import ipc_weights

    monkeypatch.setattr(ipc_weights, "MAX_LAYOUTS", 2)
    monkeypatch.setattr(ipc_weights, "_LAYOUTS", {})
    named = new_weights(tiny(TINY_LLAMA), 30)
    first, second, third = (payload_of(named[i : i + 1]) for i in range(3))
    kept = bucket_items(first)[1]
    bucket_items(second)
    bucket_items(third)  # the first goes
    assert len(ipc_weights._LAYOUTS) == 2
    assert bucket_items(first)[1] is not kept and bucket_items(first)[1] == kept
