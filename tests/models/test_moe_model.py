"""Qwen3-MoE: its config, which layers are sparse (as in transformers), the per-expert
checkpoint names loading into the fused expert tensors, the typed errors naming the expert,
and the two forms of the torch reference agreeing."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import (
    PagedRunner,
    load_dormant,
    make_hf_model,
    materialize,
    qwen3_moe_config,
    qwen3_moe_mixed_config,
    save_checkpoint,
)
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

from dormant.layers.moe import FusedMoE
from dormant.layers.moe_reference import (
    _every_expert,
    _grouped_by_expert,
    fused_experts_reference,
    select_experts,
)
from dormant.models import (
    CausalLM,
    ModelConfig,
    UnsupportedModelError,
    WeightError,
    build_model,
    iterate_safetensors,
    iterate_safetensors_metadata,
)
from dormant.models.moe_config import MoeConfig

EXPERT = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(make_hf_model(qwen3_moe_config(), seed=5), tmp_path_factory.mktemp("m"))


def _moe_dict(**overrides: Any) -> dict[str, Any]:
    d = qwen3_moe_config().to_dict()
    d.update(architectures=["Qwen3MoeForCausalLM"], dtype="float32")
    d.update(overrides)
    return d


def _sparse_layers(model: CausalLM) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize(
    ("num_layers", "step", "mlp_only"),
    [(4, 1, []), (4, 2, []), (5, 2, [3]), (4, 1, [0, 2]), (3, 4, [])],
)
def test_sparse_layers_are_those_transformers_builds(num_layers, step, mlp_only) -> None:
    options = qwen3_moe_config().to_dict()
    options.update(num_hidden_layers=num_layers, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    hf_config = Qwen3MoeConfig(**options)
    hf_sparse = [
        i
        for i, layer in enumerate(HFQwen3Moe(hf_config).model.layers)
        if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    ]
    d = hf_config.to_dict()
    d["architectures"] = ["Qwen3MoeForCausalLM"]
    with torch.device("meta"):
        ours = build_model(ModelConfig.from_dict(d))
    assert _sparse_layers(ours) == hf_sparse


def test_config_reads_the_moe_keys() -> None:
    config = ModelConfig.from_dict(_moe_dict(mlp_only_layers=[1]))
    assert config.moe == MoeConfig(8, 2, 32, True, 1, (1,))
    written = _moe_dict()  # transformers 5 writes num_local_experts
    written["num_local_experts"] = written.pop("num_experts", 8)
    assert ModelConfig.from_dict(written).moe == ModelConfig.from_dict(_moe_dict()).moe
    dropped = ("num_experts", "num_local_experts", "norm_topk_prob")
    bare = {k: v for k, v in _moe_dict().items() if k not in dropped}
    assert ModelConfig.from_dict(bare).moe.num_experts == 128  # transformers' defaults
    assert ModelConfig.from_dict(_moe_dict(architectures=["Qwen3ForCausalLM"])).moe is None


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"num_experts_per_tok": 9}, ValueError, "exceeds num_experts"),
        ({"moe_intermediate_size": 0}, ValueError, "moe_intermediate_size"),
        ({"decoder_sparse_step": 0}, ValueError, "decoder_sparse_step"),
        ({"shared_expert_intermediate_size": 64}, UnsupportedModelError, "shared experts"),
    ],
)
def test_invalid_moe_configs_raise(overrides: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ModelConfig.from_dict(_moe_dict(**overrides))


def test_a_dense_architecture_takes_no_moe_settings() -> None:
    config = ModelConfig.from_dict(_moe_dict())
    with pytest.raises(ValueError, match="takes no MoE settings"):
        dataclasses.replace(config, architecture="Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="needs MoE settings"):
        dataclasses.replace(config, moe=None)


def test_per_expert_names_land_in_the_fused_tensors(moe_checkpoint: Path) -> None:
    model = load_dormant(moe_checkpoint)
    checkpoint = dict(iterate_safetensors(moe_checkpoint))
    assert set(model.expected_weight_shapes()) == set(checkpoint)
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in checkpoint.values())
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, FusedMoE) and experts.w13_weight.shape == (8, 64, 64)
    prefix = "model.layers.1.mlp.experts"
    for e in range(8):
        gate, up = experts.w13_weight[e].chunk(2)
        assert torch.equal(gate, checkpoint[f"{prefix}.{e}.gate_proj.weight"])
        assert torch.equal(up, checkpoint[f"{prefix}.{e}.up_proj.weight"])
        assert torch.equal(experts.w2_weight[e], checkpoint[f"{prefix}.{e}.down_proj.weight"])
    router = model.model.layers[1].mlp.gate.weight
    assert torch.equal(router, checkpoint["model.layers.1.mlp.gate.weight"])


def test_refit_of_one_expert_writes_only_it_in_place(moe_checkpoint: Path) -> None:
    model = load_dormant(moe_checkpoint)
    experts = model.model.layers[0].mlp.experts
    before = experts.w2_weight.detach().clone(), experts.w13_weight.detach().clone()
    pointers = experts.w2_weight.data_ptr(), experts.w13_weight.data_ptr()
    new = torch.full((64, 32), 0.5)
    assert model.load_weights([(f"{EXPERT}.2.down_proj.weight", new)]) == {
        f"{EXPERT}.2.down_proj.weight"
    }
    assert torch.equal(experts.w2_weight[2], new)
    others = [e for e in range(8) if e != 2]
    assert torch.equal(experts.w2_weight[others], before[0][others])
    assert torch.equal(experts.w13_weight, before[1])
    assert (experts.w2_weight.data_ptr(), experts.w13_weight.data_ptr()) == pointers


def test_wrong_expert_names_and_shapes_are_named_and_nothing_is_written(
    moe_checkpoint: Path,
) -> None:
    model = load_dormant(moe_checkpoint)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    replaced = f"{EXPERT}.3.up_proj.weight"
    items = [i for i in iterate_safetensors_metadata(moe_checkpoint) if i[0] != replaced]
    bad = [
        (f"{EXPERT}.8.gate_proj.weight", torch.Size([32, 64]), torch.float32),  # no expert 8
        (replaced, torch.Size([64, 32]), torch.float32),  # transposed
        (f"{EXPERT}.1.gate_prj.weight", torch.Size([32, 64]), torch.float32),
    ]
    with pytest.raises(WeightError) as info:
        model.check_weights(items + bad)
    problems = info.value.problems
    assert len(problems) == 3
    assert f"{EXPERT}.8.gate_proj.weight: no such expert: this layer has experts 0..7" in problems
    assert f"{EXPERT}.3.up_proj.weight: shape (64, 32), expected (32, 64)" in problems[1]
    assert f"did you mean '{EXPERT}.1.gate_proj.weight'" in problems[2]
    with pytest.raises(WeightError, match=r"experts\.5\.down_proj\.weight: shape \(64, 31\)"):
        model.load_weights([(f"{EXPERT}.5.down_proj.weight", torch.zeros(64, 31))])
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_expert_names_for_a_dense_layer_point_at_its_mlp(tmp_path: Path) -> None:
    path = save_checkpoint(make_hf_model(qwen3_moe_mixed_config(), seed=1), tmp_path)
    model = load_dormant(path)
    with pytest.raises(WeightError, match=r"layer is dense .*model\.layers\.1\.mlp\.up_proj"):
        model.check_weights(
            [("model.layers.1.mlp.experts.0.up_proj.weight", (48, 64), torch.float32)]
        )


def test_random_init_fills_every_expert_and_runs() -> None:
    config = ModelConfig.from_dict(_moe_dict())
    with torch.device("meta"):
        model = build_model(config)
    materialize(model, torch.device("cpu"))
    model.init_buffers()
    model.reset_kv_scales()
    model.init_random_weights(seed=3)
    experts = model.model.layers[0].mlp.experts
    for e in range(8):
        assert 0.015 < float(experts.w13_weight[e].std()) < 0.025
        assert 0.015 < float(experts.w2_weight[e].std()) < 0.025
    assert not torch.equal(experts.w13_weight[0], experts.w13_weight[1])
    (logits,) = PagedRunner(model, 1, 16, 4).step([[1, 2, 3]])
    assert logits.shape == (3, 256) and torch.isfinite(logits).all()


def test_the_router_ticket_is_a_zeroed_runtime_buffer_not_a_weight() -> None:
    """The fused router's ticket (layers/triton_router.py) must be 0 before the first launch:
    materialized uninitialised (as the engine adopts buffers), ``init_buffers`` zeroes it. It
    is no checkpoint tensor (refits and ``parameters()`` never see it)."""
    config = ModelConfig.from_dict(_moe_dict(mlp_only_layers=[1]))
    with torch.device("meta"):
        model = build_model(config)
    materialize(model, torch.device("cpu"))
    sparse = [model.model.layers[i].mlp for i in _sparse_layers(model)]
    assert sparse and len(sparse) < len(model.model.layers)
    for block in sparse:
        block.router_ticket.fill_(7)  # what an uninitialised buffer may hold
    model.init_buffers()
    for block in sparse:
        assert block.router_ticket.dtype == torch.int32 and block.router_ticket.tolist() == [0]
    assert not any("router_ticket" in name for name in model.expected_weight_shapes())
    assert not any("router_ticket" in name for name in model.state_dict())
    tickets = {id(block.router_ticket) for block in sparse}
    assert len(tickets) == len(sparse), "one ticket per layer: launches never share one"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_reference_forms_agree(dtype: torch.dtype, renormalize: bool) -> None:
    """The grouped form (CPU) and the every-expert form (GPU) compute the same values; every
    pair lands once, also with experts no token picked."""
    generator = torch.Generator().manual_seed(0)
    num_tokens, num_experts, top_k, hidden, inter = 13, 8, 3, 32, 24
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    w13 = (0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=generator)).to(dtype)
    w2 = (0.2 * torch.randn(num_experts, hidden, inter, generator=generator)).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, 5] = -100.0  # expert 5 is never chosen
    weights, ids = select_experts(logits.to(dtype), top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert not (ids == 5).any()
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens))
    grouped = _grouped_by_expert(x, w13, w2, weights, ids)
    assert torch.equal(grouped, fused_experts_reference(x, w13, w2, weights, ids))
    # bfloat16 rounds after every matmul, so both forms agree exactly; in float32 a CPU BLAS
    # picks its blocking (its summation order) by the number of rows, so the same row computed
    # in a 13-row and in a 3-row matmul may differ in its last bits (seen on an AMD EPYC)
    exact = 0.0 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        _every_expert(x, w13, w2, weights, ids), grouped, atol=exact, rtol=exact
    )
    expected = torch.zeros(num_tokens, hidden)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = (x[t].float() @ w13[e].float().T).chunk(2)
            out = (torch.nn.functional.silu(gate) * up) @ w2[e].float().T
            expected[t] += float(weights[t, j]) * out
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped.float(), expected, atol=tolerance, rtol=tolerance)


def test_transformers_5_fused_names_load_as_aliases(moe_checkpoint: Path) -> None:
    """A trainer on transformers 5 holds the experts fused (``experts.gate_up_proj``,
    ``experts.down_proj``); its ``state_dict()`` loads as well as the per-expert names."""
    reference = load_dormant(moe_checkpoint)
    hf_state = make_hf_model(qwen3_moe_config(), seed=5).state_dict()
    assert f"{EXPERT}.gate_up_proj" in hf_state and f"{EXPERT}.0.gate_proj.weight" not in hf_state
    model = load_dormant(moe_checkpoint)
    for param in model.parameters():
        param.data.zero_()
    items = [(name, t.shape, t.dtype) for name, t in hf_state.items()]
    model.check_weights(items, require_complete=True)  # the aliases cover every expert name
    assert model.load_weights(hf_state.items()) == set(model.expected_weight_shapes())
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in
                   model.expected_weight_shapes())  # fmt: skip
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    with pytest.raises(WeightError, match=r"experts\.gate_up_proj: shape \(8, 32, 64\)"):
        model.load_weights([(f"{EXPERT}.gate_up_proj", torch.zeros(8, 32, 64))])
    with pytest.raises(WeightError, match=r"experts\.5\.up_proj\.weight: missing"):
        partial = [i for i in items if not i[0].endswith("gate_up_proj")]
        model.check_weights(partial, require_complete=True)
