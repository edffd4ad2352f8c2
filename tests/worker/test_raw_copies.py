"""A copy plan's byte runs issued to the driver (``dormant/worker/raw_copies.py``), on the CPU:
the calls are recorded instead of made. The copies themselves, on a GPU, are
``tests/gpu/test_raw_copies_gpu.py``'s."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from dormant.memory.errors import DriverError
from dormant.worker import raw_copies
from dormant.worker.copy_plans import CopyPlans
from dormant.worker.ipc_weights import bucket_items, make_flattened_bucket
from dormant.worker.raw_copies import RawRuns, raw_runs_of
from dormant.worker.transfer_errors import WeightTransferError
from tests.worker.test_copy_plan import TINY_LLAMA, new_weights, state, tiny

STREAM = 0x5EED


def test_each_run_is_one_driver_copy_from_the_buckets_address_then_one_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(raw_copies, "call", lambda *a: calls.append(a))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: STREAM + i, raising=False)
    flat = torch.zeros(256, dtype=torch.uint8)
    RawRuns(1, ((1 << 20, 0, 64), (1 << 21, 128, 96))).issue_and_wait(flat)
    base = flat.data_ptr()
    assert calls == [
        ("cuMemcpyAsync", 1 << 20, base, 64, STREAM + 1),
        ("cuMemcpyAsync", 1 << 21, base + 128, 96, STREAM + 1),
        ("cuStreamSynchronize", STREAM + 1),
    ]


def test_host_destinations_have_no_raw_runs() -> None:
    model = tiny(TINY_LLAMA)
    flat, metadata = make_flattened_bucket(new_weights(model, 1))
    _, items = bucket_items({"flattened_tensor": flat, "metadata": metadata})
    assert CopyPlans().get(model, items).raw is None
    assert raw_runs_of([(torch.zeros(8, dtype=torch.uint8), 0, 8)]) is None
    assert raw_runs_of([]) is None


class _FailingRuns:
    """Stands in for a plan's ``RawRuns`` on a device whose driver copy fails."""

    def can_copy(self, flat_bytes: torch.Tensor) -> bool:
        return True

    def issue_and_wait(self, flat_bytes: torch.Tensor) -> None:
        raise DriverError("cuMemcpyAsync failed: CUDA_ERROR_ILLEGAL_ADDRESS")


def test_a_failed_driver_copy_is_a_transfer_error_and_every_weight_is_stale() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    named = new_weights(model, 2)
    flat, metadata = make_flattened_bucket(named)
    flat_bytes, items = bucket_items({"flattened_tensor": flat, "metadata": metadata})
    plan = dataclasses.replace(plans.get(model, items), raw=_FailingRuns())
    before = state(model)
    with pytest.raises(WeightTransferError, match=r"ILLEGAL_ADDRESS.*marked stale"):
        plan.run(model, flat_bytes)
    assert model.weight_observer.stale == set(model.expected_weight_shapes())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # torch's unrun


def test_a_short_bucket_is_refused_before_the_driver_is_called() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    flat, metadata = make_flattened_bucket(new_weights(model, 3))
    flat_bytes, items = bucket_items({"flattened_tensor": flat, "metadata": metadata})
    plan = dataclasses.replace(plans.get(model, items), raw=_FailingRuns())
    with pytest.raises(WeightTransferError, match="the bucket holds"):
        plan.run(model, flat_bytes[:-256])
    assert model.weight_observer.stale == set()
