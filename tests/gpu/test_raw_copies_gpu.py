"""A copy plan's byte runs issued to the driver (``dormant/worker/raw_copies.py``) on the GPU:
a bf16 bucket into a bf16 model is one driver copy and writes exactly what ``load_weights`` of the
same tensors writes, as torch's copies do; a cast, or a bucket on the host, goes through torch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from benchmarks.refit import TINY, build
from dormant.models import CausalLM, ModelConfig
from dormant.worker import raw_copies
from dormant.worker.copy_plans import CopyPlans
from dormant.worker.ipc_weights import bucket_items, make_flattened_bucket

pytestmark = pytest.mark.gpu


@pytest.fixture
def model() -> Iterator[CausalLM]:
    built = build(ModelConfig.from_dict(TINY), torch.device("cuda"))
    yield built
    built.memory.close()
    torch.cuda.empty_cache()


Named = list[tuple[str, Tensor]]


def _weights(model: CausalLM, seed: int, dtype: torch.dtype, device: str) -> Named:
    generator = torch.Generator().manual_seed(seed)
    shapes = model.expected_weight_shapes().items()
    return [(n, torch.randn(s, generator=generator).to(device, dtype)) for n, s in shapes]


def _refit(plans: CopyPlans, model: CausalLM, named: Named):
    flat, metadata = make_flattened_bucket(named)
    flat_bytes, items = bucket_items({"flattened_tensor": flat, "metadata": metadata})
    plan = plans.get(model, items)
    plan.run(model, flat_bytes)
    return plan


def _state(model: CausalLM) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _loaded(model: CausalLM, named: Named) -> dict[str, Tensor]:
    reference = build(model.config, torch.device("cuda"))
    reference.load_weights(named)
    expected = _state(reference)
    reference.memory.close()
    return expected


@pytest.mark.parametrize("is_enabled", [True, False])
def test_a_bf16_bucket_is_one_driver_copy_and_writes_what_load_weights_writes(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch, is_enabled: bool
) -> None:
    monkeypatch.setattr(raw_copies, "ENABLED", is_enabled)
    named = _weights(model, 5, torch.bfloat16, "cuda")
    plan = _refit(CopyPlans(), model, named)
    assert (plan.raw is not None) is is_enabled
    if is_enabled:
        assert len(plan.raw.runs) == 1 and plan.raw.device_index == torch.cuda.current_device()
    torch.cuda.synchronize()
    expected = _loaded(model, named)
    assert all(torch.equal(p, expected[n]) for n, p in _state(model).items())


def test_a_cast_or_a_bucket_on_the_host_goes_through_torch(model: CausalLM) -> None:
    plans = CopyPlans()
    named = _weights(model, 6, torch.float32, "cuda")
    assert _refit(plans, model, named).raw is None  # fp32 into bf16: cast on copy
    expected = _loaded(model, named)
    assert all(torch.equal(p, expected[n]) for n, p in _state(model).items())
    host = _weights(model, 7, torch.bfloat16, "cpu")
    plan = _refit(plans, model, host)  # planned for the device, the bucket on the host
    assert plan.raw is not None and not plan.raw.can_copy(make_flattened_bucket(host)[0])
    expected = _loaded(model, host)
    assert all(torch.equal(p, expected[n]) for n, p in _state(model).items())
