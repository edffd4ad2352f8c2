"""The cached copy plan of a flattened bucket (``dormant/worker/copy_plan.py``), on CPU tensors
through the same code the IPC path runs once the bucket is rebuilt: ``bucket_items`` of the
payload, then ``CopyPlans.get(...).run(...)``. Every case checks the values against
``model.load_weights`` of the same tensors."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import weakref

import pytest
import torch
from torch import Tensor

from dormant.memory import MemoryManager
from dormant.models import CausalLM, ModelConfig, WeightError, build_model
from dormant.worker.copy_plan import LoaderCall, Run, StridedCopy
from dormant.worker.copy_plans import CopyPlans
from dormant.worker.ipc_payload import FlattenedTensorMetadata
from dormant.worker.ipc_weights import bucket_items, make_flattened_bucket
from dormant.worker.refit_record import RefitRecord
from dormant.worker.transfer_errors import WeightTransferError

# Every tensor's bytes (fp32 or bf16) are a multiple of the pool's 256-byte alignment: adopted
# parameters are back to back in one block, in module order.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 128,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64,
    "torch_dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip
TINY_MOE = {
    **TINY_LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
}  # fmt: skip
Named = list[tuple[str, Tensor]]


def tiny(config: dict, dtype: str = "float32", pooled: bool = True) -> CausalLM:
    """Built on meta and adopted into a host pool, as the worker does (``pooled``), or plain."""
    config = {**config, "torch_dtype": dtype}
    with torch.device("meta" if pooled else "cpu"):
        model = build_model(ModelConfig.from_dict(config))
    if pooled:
        MemoryManager("host").adopt(model)
    model.init_buffers()
    model.reset_kv_scales()
    model.init_random_weights(0)
    model.weight_observer = RefitRecord(model.expected_weight_shapes())
    return model


def new_weights(model: CausalLM, seed: int, dtype: torch.dtype = torch.float32) -> Named:
    generator = torch.Generator().manual_seed(seed)
    shapes = model.expected_weight_shapes()
    return [(n, torch.randn(s, generator=generator).to(dtype)) for n, s in shapes.items()]


def hf_order(named: Named) -> Named:
    """The order of a trainer's ``named_parameters()``: per layer q, k, v, o, gate, up, down,
    then the two norms (the engine's pool has the norms before each block)."""
    rank = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    rank += ("input_layernorm", "post_attention_layernorm")

    def key(item: tuple[str, Tensor]) -> tuple[int, int]:
        parts = item[0].split(".")
        layer = int(parts[2]) if parts[1] == "layers" else (-1 if "embed" in item[0] else 99)
        leaf = next((i for i, r in enumerate(rank) if r in parts), -1)
        return layer, leaf

    return sorted(named, key=key)


def state(model: CausalLM) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def expected_state(config: dict, named: Named, dtype: str = "float32") -> dict[str, Tensor]:
    reference = tiny(config, dtype, pooled=False)
    reference.load_weights(named)
    return state(reference)


def assert_state_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def refit(plans: CopyPlans, model: CausalLM, named: Named) -> set[str]:
    flat, metadata = make_flattened_bucket(named)
    flat_bytes, items = bucket_items({"flattened_tensor": flat, "metadata": metadata})
    return plans.get(model, items).run(model, flat_bytes)


def plan_of(plans: CopyPlans, model: CausalLM, named: Named):
    flat, metadata = make_flattened_bucket(named)
    return plans.get(model, bucket_items({"flattened_tensor": flat, "metadata": metadata})[1])


# ── merging ────────────────────────────────────────────────────────────────────────────────


def test_a_bucket_in_the_models_order_is_one_copy() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    named = new_weights(model, 1)
    plan = plan_of(plans, model, named)
    assert plan.num_copies == 1 and isinstance(plan.steps[0], Run)
    assert plan.is_untracked  # it runs outside no_grad, even into parameters requiring grad
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    assert refit(plans, model, named) == set(model.expected_weight_shapes())
    assert_state_equal(state(model), expected_state(TINY_LLAMA, named))


def test_byte_runs_from_a_buffer_that_requires_grad_record_no_autograd_graph() -> None:
    """Outside no_grad, a Run's source is the buffer's uint8 bytes, which never require grad:
    nothing is recorded that would keep the sender's (IPC) buffer alive."""
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    named = new_weights(model, 9)  # float32, as the model: SGLang's older bucket of one dtype
    flat = torch.cat([t.reshape(-1) for _, t in named]).requires_grad_(True)
    ends = list(itertools.accumulate(t.numel() for _, t in named))
    metadata = [
        FlattenedTensorMetadata(n, t.shape, t.dtype, end - t.numel(), end, t.numel())
        for (n, t), end in zip(named, ends, strict=True)
    ]
    flat_bytes, items = bucket_items({"flattened_tensor": flat, "metadata": metadata})
    plan = plans.get(model, items)
    assert plan.is_untracked and not flat_bytes.requires_grad
    plan.run(model, flat_bytes)
    assert all(step.dst.grad_fn is None for step in plan.steps if isinstance(step, Run))
    assert_state_equal(state(model), expected_state(TINY_LLAMA, named))


def test_a_trainers_order_merges_what_is_adjacent_in_both() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    named = hf_order(new_weights(model, 2))
    # per layer: q k v o | gate up down | input_layernorm | post_attention_layernorm; and the
    # embedding, the final norm + lm_head
    assert plan_of(plans, model, named).num_copies == 1 + 2 * 4 + 1
    refit(plans, model, named)
    assert_state_equal(state(model), expected_state(TINY_LLAMA, named))


def test_separate_parameters_merge_only_within_a_parameter() -> None:
    """Without the pool each parameter is its own storage: q, k, v still merge into qkv_proj,
    gate and up into gate_up_proj."""
    model, plans = tiny(TINY_LLAMA, pooled=False), CopyPlans()
    named = new_weights(model, 3)
    assert plan_of(plans, model, named).num_copies == len(list(model.parameters()))
    refit(plans, model, named)
    assert_state_equal(state(model), expected_state(TINY_LLAMA, named))


def test_fp32_into_bf16_casts_per_run() -> None:
    model, plans = tiny(TINY_LLAMA, "bfloat16"), CopyPlans()
    named = new_weights(model, 4)
    plan = plan_of(plans, model, named)
    assert plan.num_copies == 1 and plan.steps[0].dst.dtype == torch.bfloat16
    refit(plans, model, named)
    assert_state_equal(state(model), expected_state(TINY_LLAMA, named, "bfloat16"))


def test_mixed_dtypes_split_the_runs() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    named = [(n, t.bfloat16() if i % 2 else t) for i, (n, t) in enumerate(new_weights(model, 5))]
    assert plan_of(plans, model, named).num_copies == len(named)  # no neighbours share a dtype
    refit(plans, model, named)
    assert_state_equal(state(model), expected_state(TINY_LLAMA, named))


def test_strided_copies_of_fused_experts() -> None:
    """transformers 5's ``experts.gate_up_proj`` lands in two halves of ``w13_weight`` along
    dim 1: strided on both sides, one copy each."""
    model, plans = tiny(TINY_MOE), CopyPlans()
    fused = [n for n in model.weight_table() if n.endswith("experts.gate_up_proj")]
    table = model.weight_table()
    generator = torch.Generator().manual_seed(6)
    named = [(n, torch.randn(table[n].full_shape, generator=generator)) for n in fused]
    plan = plan_of(plans, model, named)
    assert [type(s) for s in plan.steps] == [StridedCopy] * 2 * len(fused)
    assert not plan.is_untracked  # a view of a parameter: written under no_grad
    before = state(model)
    assert refit(plans, model, named) == {n for f in fused for n in table[f].covers}
    reference = tiny(TINY_MOE, pooled=False)
    reference.load_state_dict(before, strict=False)
    reference.load_weights(named)
    assert_state_equal(state(model), state(reference))


def test_a_loader_that_does_more_than_copy_runs_itself() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    table = model.weight_table()
    name = "model.norm.weight"

    def scaled_loader(param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        param.data.copy_(loaded)
        param.data.mul_(2.0)  # an in-place op a plan could not repeat

    table[name] = dataclasses.replace(table[name], loader=scaled_loader)
    named = new_weights(model, 7)
    plan = plan_of(plans, model, named)
    assert sum(isinstance(s, LoaderCall) for s in plan.steps) == 1 and not plan.is_untracked
    refit(plans, model, named)
    assert torch.equal(model.model.norm.weight, 2.0 * dict(named)[name])


# ── validation, caching, invalidation ──────────────────────────────────────────────────────


def test_a_bad_entry_raises_writes_nothing_and_is_not_cached() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    named = new_weights(model, 8)
    bad = [("model.norm.weigth" if n == "model.norm.weight" else n, t) for n, t in named]
    before = state(model)
    for _ in range(2):
        with pytest.raises(WeightError, match="weigth"):
            refit(plans, model, bad)
    assert plans.num_built == 0
    assert_state_equal(state(model), before)
    assert model.weight_observer.stale == set()


def test_metadata_past_the_buffer_is_a_transfer_error() -> None:
    model = tiny(TINY_LLAMA)
    flat, metadata = make_flattened_bucket(new_weights(model, 9))
    metadata[-1].end_idx += 4
    with pytest.raises(WeightTransferError, match=r"lm_head\.weight"):
        bucket_items({"flattened_tensor": flat, "metadata": metadata})


def test_a_cached_plan_refuses_a_shorter_buffer() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    named = new_weights(model, 10)
    plan = plan_of(plans, model, named)
    before = state(model)
    with pytest.raises(WeightTransferError, match="bytes"):
        plan.run(model, torch.zeros(plan.num_bytes - 1, dtype=torch.uint8))
    assert_state_equal(state(model), before)


def test_plans_are_cached_by_layout() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    first, second = new_weights(model, 11), new_weights(model, 12)
    refit(plans, model, first)
    refit(plans, model, second)  # same layout, other values: the same plan
    assert plans.num_built == 1
    assert_state_equal(state(model), expected_state(TINY_LLAMA, second))
    refit(plans, model, second[:5])  # another layout
    refit(plans, model, [(n, t.bfloat16()) for n, t in second])  # other dtypes
    assert plans.num_built == 3


def test_a_rematerialised_parameter_rebuilds_the_plan() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    refit(plans, model, new_weights(model, 13))
    norm = model.model.norm.weight
    norm.data = torch.empty_like(norm.data)  # its memory moved
    named = new_weights(model, 14)
    refit(plans, model, named)
    assert plans.num_built == 2
    assert_state_equal(state(model), expected_state(TINY_LLAMA, named))


def test_a_dropped_model_drops_its_plans() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    refit(plans, model, new_weights(model, 15))
    storage = weakref.ref(model.lm_head.weight)
    del model
    gc.collect()
    assert storage() is None and len(plans._plans) == 0


def test_the_observer_hears_of_writes_and_refusals() -> None:
    model, plans = tiny(TINY_LLAMA), CopyPlans()
    record = model.weight_observer
    record.discarded()
    named = new_weights(model, 16)
    refit(plans, model, named[:4])
    assert record.stale == set(model.expected_weight_shapes()) - {n for n, _ in named[:4]}

    class Asleep(Exception):
        pass

    def refuse() -> None:
        raise Asleep

    record._check_writable = refuse
    before = state(model)
    with pytest.raises(Asleep):
        refit(plans, model, named)
    assert_state_equal(state(model), before)
