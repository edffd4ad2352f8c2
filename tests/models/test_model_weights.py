"""Weight names, validation without side effects, in-place loading, random init, and the
meta-device build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import (
    PagedRunner,
    llama_gqa_config,
    load_dormant,
    make_hf_model,
    materialize,
    qwen3_config,
    save_checkpoint,
)

from dormant.models import (
    CausalLM,
    ModelConfig,
    WeightError,
    build_model,
    iterate_safetensors,
    iterate_safetensors_metadata,
)


@pytest.fixture(scope="module")
def qwen3_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf_model = make_hf_model(qwen3_config(tie_word_embeddings=True), seed=3)
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("qwen3_tied"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf_model = make_hf_model(llama_gqa_config(), seed=4)
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("llama"))


def _snapshot(model: CausalLM) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: CausalLM, before: dict[str, torch.Tensor]) -> None:
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} was modified"


@pytest.mark.parametrize("fixture", ["qwen3_tied", "llama"])
def test_parameters_are_exactly_the_checkpoint(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(fixture)
    model = load_dormant(path)
    checkpoint = dict(iterate_safetensors(path))
    assert set(model.expected_weight_shapes()) == set(checkpoint)
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params == sum(t.numel() for t in checkpoint.values())
    all_param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    persistent = set(model.state_dict()) - all_param_names
    assert all(name.endswith(("k_scale", "v_scale")) for name in persistent)
    assert any(name.endswith("cos_sin_cache") for name, _ in model.named_buffers())


def test_check_weights_reports_every_bad_entry_and_writes_nothing(qwen3_tied: Path) -> None:
    model = load_dormant(qwen3_tied)
    before = _snapshot(model)
    items = list(iterate_safetensors_metadata(qwen3_tied))
    model.check_weights(items, require_complete=True)  # the real checkpoint is fine
    corrupted = []
    for name, shape, dtype in items:
        if name == "model.layers.0.self_attn.q_proj.weight":
            name = "model.layers.0.self_attn.q_prj.weight"
        elif name == "model.layers.1.mlp.up_proj.weight":
            shape = torch.Size([7, 64])
        elif name == "model.norm.weight":
            dtype = torch.int8
        corrupted.append((name, shape, dtype))
    with pytest.raises(WeightError) as info:
        model.check_weights(corrupted, require_complete=True)
    message = str(info.value)
    assert len(info.value.problems) == 4  # three bad entries + the q_proj now missing
    assert "q_prj" in message and "did you mean 'model.layers.0.self_attn.q_proj.weight'" in message
    assert "(7, 64), expected (192, 64)" in message and "torch.int8" in message
    assert "missing" in message and "Nothing was written" in message
    _assert_unchanged(model, before)


def test_load_weights_checks_each_entry_before_writing(qwen3_tied: Path) -> None:
    model = load_dormant(qwen3_tied)
    before = _snapshot(model)
    wrong = torch.zeros(7, 64)
    with pytest.raises(WeightError, match=r"mlp\.up_proj\.weight: shape"):
        model.load_weights([("model.layers.1.mlp.up_proj.weight", wrong)])
    _assert_unchanged(model, before)


def test_load_is_in_place_and_casts(qwen3_tied: Path) -> None:
    model = load_dormant(qwen3_tied, dtype=torch.bfloat16)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    checkpoint = dict(iterate_safetensors(qwen3_tied))
    doubled = {name: 2 * t for name, t in checkpoint.items()}
    assert model.load_weights(doubled.items()) == set(checkpoint)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, doubled["model.embed_tokens.weight"].to(torch.bfloat16))
    assert model.lm_head.weight is embed  # tied


def test_tied_lm_head_in_checkpoint_is_ignored(qwen3_tied: Path) -> None:
    model = load_dormant(qwen3_tied)
    weights = [("lm_head.weight", torch.zeros(256, 64)), ("x.rotary_emb.inv_freq", torch.ones(2))]
    model.check_weights([(n, t.shape, t.dtype) for n, t in weights])
    assert model.load_weights(weights) == set()
    assert model.model.embed_tokens.weight.abs().sum() > 0


def test_kv_scales_load_and_survive_init_buffers(qwen3_tied: Path) -> None:
    model = load_dormant(qwen3_tied)
    scales = [
        ("model.layers.1.self_attn.k_scale", torch.tensor(0.5)),
        ("model.layers.1.self_attn.v_scale", torch.tensor([0.25], dtype=torch.bfloat16)),
    ]
    model.check_weights([(n, t.shape, t.dtype) for n, t in scales])
    assert model.load_weights(scales) == {n for n, _ in scales}
    model.init_buffers()
    model.init_random_weights(seed=0)
    layer = model.attention_layers()[1]
    assert (float(layer.k_scale), float(layer.v_scale)) == (0.5, 0.25)
    assert float(model.attention_layers()[0].k_scale) == 1.0
    assert "model.layers.1.self_attn.attn.k_scale" in model.state_dict()


def test_init_random_weights_is_deterministic() -> None:
    d = llama_gqa_config().to_dict()
    d.update(architectures=["LlamaForCausalLM"], attention_bias=True, dtype="float32")
    config = ModelConfig.from_dict(d)
    first, second, other = build_model(config), build_model(config), build_model(config)
    first.init_random_weights(seed=7)
    second.init_random_weights(seed=7)
    other.init_random_weights(seed=8)
    for (name, a), b, c in zip(
        first.named_parameters(), second.parameters(), other.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
        if "norm" in name:
            assert torch.equal(a, torch.ones_like(a)), name
        elif name.endswith("bias"):
            assert torch.equal(a, torch.zeros_like(a)), name
        else:
            assert not torch.equal(a, c), name
            assert 0.015 < float(a.std()) < 0.025, name


def test_meta_build_materializes_and_matches_eager_build(llama: Path) -> None:
    config = ModelConfig.from_pretrained(llama)
    with torch.device("meta"):
        lazy = build_model(config)
    params_before = {name: id(p) for name, p in lazy.named_parameters()}
    materialize(lazy, torch.device("cpu"))
    assert {name: id(p) for name, p in lazy.named_parameters()} == params_before
    qkv = lazy.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.device.type == "cpu" and callable(qkv.weight_loader)
    lazy.init_buffers()
    lazy.reset_kv_scales()
    lazy.init_random_weights(seed=1)

    eager = build_model(config)
    eager.init_random_weights(seed=1)
    for (name, a), (_, b) in zip(lazy.named_buffers(), eager.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    prompts = [[3, 4, 5, 6, 7]]
    lazy_logits = PagedRunner(lazy, 1, 8, 4).step(prompts)[0]
    eager_logits = PagedRunner(eager, 1, 8, 4).step(prompts)[0]
    assert torch.equal(lazy_logits, eager_logits)


def test_loading_survives_parameters_replaced_without_attributes(llama: Path) -> None:
    """An allocator may replace meta Parameters by new objects (losing ``weight_loader``):
    loading resolves loaders through the owning layers, so it still shards correctly."""
    config = ModelConfig.from_pretrained(llama)
    with torch.device("meta"):
        model = build_model(config)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype), requires_grad=False
                )
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
    model.init_buffers()
    model.reset_kv_scales()
    assert not hasattr(model.model.layers[0].self_attn.qkv_proj.weight, "weight_loader")
    assert model.load_weights(iterate_safetensors(llama)) == set(model.expected_weight_shapes())
    reference = load_dormant(llama)
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name


def _qwen3_dict() -> dict:
    return {**qwen3_config(tie_word_embeddings=False).to_dict(),
            "architectures": ["Qwen3ForCausalLM"]}  # fmt: skip


def test_the_merge_tickets_are_zeroed_runtime_buffers_not_weights() -> None:
    """Each attention layer's merge tickets (layers/triton_attention.py) must be 0 before the
    first launch: materialized uninitialised (as the engine adopts buffers), ``init_buffers``
    zeroes them. They are no checkpoint tensor, and no two layers share them."""
    with torch.device("meta"):
        model = build_model(ModelConfig.from_dict(_qwen3_dict()))
    materialize(model, torch.device("cpu"))
    layers = model.attention_layers()
    for layer in layers:
        layer.merge_tickets.fill_(7)  # what an uninitialised buffer may hold
    model.init_buffers()
    for layer in layers:
        assert layer.merge_tickets.dtype == torch.int32
        assert int(layer.merge_tickets.count_nonzero()) == 0
    assert not any("merge_tickets" in name for name in model.expected_weight_shapes())
    assert not any("merge_tickets" in name for name in model.state_dict())
    assert len({layer.merge_tickets.data_ptr() for layer in layers}) == len(layers)
