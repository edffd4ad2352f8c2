"""MiMo's MTP draft: config detection, the target's loading (pre-norm hidden, MTP names skipped,
logits equal to Hugging Face's Qwen2), the draft's loading by checkpoint names with the target's
embedding and head shared, and its forward through the paged KV cache against a plain-torch
reference written from the checkpoint tensors."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from tiny_mimo import MTP_LAYER_LEAVES, save_tiny_mimo
from tiny_models import load_dormant, materialize
from torch import Tensor
from transformers import Qwen2ForCausalLM

from dormant.layers.context import forward_context
from dormant.models import (
    ModelConfig,
    UnsupportedModelError,
    WeightError,
    iterate_safetensors,
    iterate_safetensors_metadata,
)
from dormant.models.base import CausalLM
from dormant.models.mimo import MiMoForCausalLM, is_mtp_weight
from dormant.models.mtp import MTPDraft, num_mtp_layers
from tests.layers.attention_metadata import build_attention_metadata

BLOCK_SIZE = 4
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPTS = [[5, 17, 42, 99, 7, 3, 64], [1, 100, 3, 64, 12, 9, 33, 120, 11, 2]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen2ForCausalLM, dict, Path]:
    path = tmp_path_factory.mktemp("mimo")
    hf_model, tensors = save_tiny_mimo(path, num_mtp_layers=2)
    return hf_model, tensors, path


def load_draft(target: CausalLM, path: Path, device: str = "cpu") -> MTPDraft:
    with torch.device("meta"):
        draft = MTPDraft.for_target(target)
    materialize(draft, torch.device(device))
    draft.init_buffers()
    draft.reset_kv_scales()
    mtp_names = [(n, t) for n, t in iterate_safetensors(path) if is_mtp_weight(n)]
    assert draft.load_weights(mtp_names) == set(draft.expected_weight_shapes())
    return draft


# --- config ------------------------------------------------------------------------------------


def test_config_carries_mtp_layers(checkpoint: tuple) -> None:
    _, _, path = checkpoint
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == "MiMoForCausalLM" and config.attention_bias  # Qwen2's biases
    assert config.num_nextn_predict_layers == 2 and num_mtp_layers(config) == 2
    plain = dataclasses.replace(config, architecture="Qwen2ForCausalLM")
    assert num_mtp_layers(plain) == 0  # a layout this module does not build
    assert num_mtp_layers(dataclasses.replace(config, num_nextn_predict_layers=0)) == 0


def test_a_config_without_mtp_layers_is_refused(checkpoint: tuple) -> None:
    _, _, path = checkpoint
    target = load_dormant(path)
    config = dataclasses.replace(target.config, num_nextn_predict_layers=0)
    with pytest.raises(UnsupportedModelError, match=r"no MTP layers.*MiMoForCausalLM"):
        MTPDraft(config, target.model.embed_tokens, target.lm_head)
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be >= 0"):
        dataclasses.replace(config, num_nextn_predict_layers=-1)


# --- the target --------------------------------------------------------------------------------


def run_target(target: CausalLM, caches: list[Tensor], prompts: list[list[int]]) -> tuple:
    """One prefill of ``prompts`` through fresh paged caches: (metadata, positions, hidden)."""
    device = caches[0].device
    tables = block_tables(len(prompts), device)
    for layer, cache in zip(target.attention_layers(), caches, strict=True):
        layer.kv_cache = cache
    lens = torch.tensor([len(p) for p in prompts])
    meta = build_attention_metadata(tables, lens, lens, BLOCK_SIZE)
    positions = torch.cat([torch.arange(len(p)) for p in prompts]).to(device)
    input_ids = torch.tensor([t for p in prompts for t in p], device=device)
    with forward_context(meta), torch.no_grad():
        hidden = target(input_ids, positions)
    return meta, positions, hidden


def block_tables(num_seqs: int, device: torch.device | str = "cpu") -> Tensor:
    order = torch.randperm(num_seqs * 8, generator=torch.Generator().manual_seed(0))
    return order.view(num_seqs, 8).to(device=device, dtype=torch.int32)


def nan_caches(model: CausalLM | MTPDraft, device: str = "cpu") -> list[Tensor]:
    """NaN everywhere: reading a slot that was never written poisons the output."""
    return [
        torch.full((2, 32, BLOCK_SIZE, a.num_kv_heads, a.head_dim), float("nan"), device=device)
        for a in model.attention_layers()
    ]


def test_target_loads_skipping_mtp_names_and_matches_hf(checkpoint: tuple) -> None:
    hf_model, _, path = checkpoint
    target = load_dormant(path)  # asserts every target weight loaded
    assert isinstance(target, MiMoForCausalLM)
    assert not any(is_mtp_weight(n) for n in target.expected_weight_shapes())
    target.check_weights(list(iterate_safetensors_metadata(path)), require_complete=True)
    _, _, hidden = run_target(target, nan_caches(target), PROMPTS)
    logits = target.compute_logits(hidden).split([len(p) for p in PROMPTS])
    for prompt, ours in zip(PROMPTS, logits, strict=True):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt]), output_hidden_states=True)
        torch.testing.assert_close(ours, reference.logits[0].float(), rtol=1e-4, atol=1e-5)
    # forward's output is the last layer's before the final norm (what the MTP layers take).
    with torch.no_grad():
        pre_norm = _hf_pre_norm_hidden(hf_model, PROMPTS[0])
    torch.testing.assert_close(hidden[: len(PROMPTS[0])], pre_norm, rtol=1e-4, atol=1e-5)


def _hf_pre_norm_hidden(hf_model: Qwen2ForCausalLM, prompt: list[int]) -> Tensor:
    captured: list[Tensor] = []
    hook = hf_model.model.norm.register_forward_hook(lambda m, args, out: captured.append(args[0]))
    try:
        hf_model(torch.tensor([prompt]))
    finally:
        hook.remove()
    return captured[0][0]


# --- the draft's weights -----------------------------------------------------------------------


def test_draft_takes_the_checkpoint_mtp_names_and_shares_embedding_and_head(
    checkpoint: tuple,
) -> None:
    _, tensors, path = checkpoint
    target = load_dormant(path)
    draft = load_draft(target, path)
    mtp_names = {n for n in tensors if is_mtp_weight(n)}
    assert set(draft.expected_weight_shapes()) == mtp_names
    assert len(mtp_names) == 2 * len(MTP_LAYER_LEAVES)
    for name, shape in draft.expected_weight_shapes().items():
        assert shape == tensors[name].shape
    own = {id(p) for p in draft.parameters()}
    assert id(target.model.embed_tokens.weight) not in own and id(target.lm_head.weight) not in own
    assert draft.shared.embed_tokens is target.model.embed_tokens
    assert draft.shared.lm_head is target.lm_head
    assert [a.layer_idx for a in draft.attention_layers()] == [2, 3]  # after the target's


def test_draft_refuses_target_names_without_writing(checkpoint: tuple) -> None:
    _, tensors, path = checkpoint
    target = load_dormant(path)
    draft = load_draft(target, path)
    items = [(n, t.shape, t.dtype) for n, t in tensors.items()]
    with pytest.raises(WeightError, match=r"model\.embed_tokens\.weight: not an MTP weight"):
        draft.check_weights(items)
    draft.check_weights([i for i in items if is_mtp_weight(i[0])], require_complete=True)
    with pytest.raises(WeightError, match="missing from the checkpoint"):
        draft.check_weights(
            [i for i in items if i[0].startswith("model.mtp_layers.0.")], require_complete=True
        )
    name = "model.mtp_layers.1.input_proj.weight"
    before = draft.weight_table()[name].tensor.clone()
    with pytest.raises(WeightError, match="1 earlier tensors were already written"):
        draft.load_weights(
            [(name, tensors[name] + 1), ("lm_head.weight", tensors["lm_head.weight"])]
        )
    assert not torch.equal(draft.weight_table()[name].tensor, before)  # the first one landed


class RecordingObserver:
    def __init__(self) -> None:
        self.events: list[object] = []

    def before_write(self) -> None:
        self.events.append("before")

    def written(self, names: object) -> None:
        self.events.append(set(names))  # type: ignore[call-overload]

    def failed(self) -> None:
        self.events.append("failed")


def test_weight_writes_are_observed(checkpoint: tuple) -> None:
    _, tensors, path = checkpoint
    draft = load_draft(load_dormant(path), path)
    observer = RecordingObserver()
    draft.weight_observer = observer
    name = "model.mtp_layers.0.mlp.down_proj.weight"
    draft.load_weights([(name, tensors[name])])
    with pytest.raises(WeightError):
        draft.load_weights([("model.norm.weight", tensors["model.norm.weight"])])
    draft.init_random_weights(seed=3)
    assert observer.events == [
        "before",
        {name},
        "before",
        "failed",
        "before",
        set(draft.expected_weight_shapes()),
    ]


# --- the forward against a reference -----------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """HF's rotate-half rotary over ``x`` [T, heads, head_dim]."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = (
        torch.cat([angles.cos()] * 2, -1)[:, None],
        torch.cat([angles.sin()] * 2, -1)[:, None],
    )
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_mtp(
    tensors: dict[str, Tensor], layer: int, config: ModelConfig, tokens: Tensor, hidden: Tensor
) -> Tensor:
    """MTP logits of one sequence: row t pairs ``hidden[t]`` (position t) with the embedding of
    ``tokens[t]`` (the token at t + 1; zeroed at position 0); causal attention over the rows."""
    w = {leaf: tensors[f"model.mtp_layers.{layer}.{leaf}"] for leaf in MTP_LAYER_LEAVES}
    eps, num_rows = config.rms_norm_eps, tokens.shape[0]
    positions = torch.arange(num_rows)
    embeds = tensors["model.embed_tokens.weight"][tokens]
    embeds[0] = 0.0
    fused = (
        torch.cat(
            [
                rms_norm(hidden, w["hidden_layernorm.weight"], eps),
                rms_norm(embeds, w["token_layernorm.weight"], eps),
            ],
            dim=-1,
        )
        @ w["input_proj.weight"].T
    )
    x = rms_norm(fused, w["input_layernorm.weight"], eps)
    heads, kv_heads, head_dim = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    q = (x @ w["self_attn.q_proj.weight"].T + w["self_attn.q_proj.bias"]).view(-1, heads, head_dim)
    k = (x @ w["self_attn.k_proj.weight"].T + w["self_attn.k_proj.bias"]).view(
        -1, kv_heads, head_dim
    )
    v = (x @ w["self_attn.v_proj.weight"].T + w["self_attn.v_proj.bias"]).view(
        -1, kv_heads, head_dim
    )
    q, k = rotate(q, positions, config.rope_theta), rotate(k, positions, config.rope_theta)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    causal = torch.ones(num_rows, num_rows, dtype=torch.bool).tril()
    attention = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", attention, v).reshape(num_rows, -1)
    after_attention = fused + out @ w["self_attn.o_proj.weight"].T
    y = rms_norm(after_attention, w["post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(y @ w["mlp.gate_proj.weight"].T) * (
        y @ w["mlp.up_proj.weight"].T
    )
    output = after_attention + mlp @ w["mlp.down_proj.weight"].T
    return rms_norm(output, w["final_layernorm.weight"], eps) @ tensors["lm_head.weight"].T


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step", [0, 1])
def test_forward_matches_the_reference(checkpoint: tuple, step: int, device: str) -> None:
    """A prefill of two sequences with the target's own metadata and shifted tokens (each
    prompt's first sampled token appended); ``step`` 1 runs the second MTP layer."""
    _, tensors, path = checkpoint
    target = load_dormant(path, device=device)
    draft = load_draft(target, path, device)
    meta, positions, hidden = run_target(target, nan_caches(target, device), PROMPTS)
    next_tokens = [int(t) for t in target.compute_logits(hidden).argmax(-1)]
    starts = [0, len(PROMPTS[0])]
    shifted = [
        [*prompt[1:], next_tokens[start + len(prompt) - 1]]
        for prompt, start in zip(PROMPTS, starts, strict=True)
    ]
    for layer, cache in zip(draft.attention_layers(), nan_caches(draft, device), strict=True):
        layer.kv_cache = cache
    input_ids = torch.tensor([t for s in shifted for t in s], device=device)
    with forward_context(meta), torch.no_grad():
        logits = draft.compute_logits(draft(input_ids, positions, hidden, step=step))
    assert logits.dtype == torch.float32
    hidden, rows = hidden.cpu(), logits.cpu().split([len(p) for p in PROMPTS])
    for start, tokens, ours in zip(starts, shifted, rows, strict=True):
        own_hidden = hidden[start : start + len(tokens)]
        expected = reference_mtp(tensors, step, target.config, torch.tensor(tokens), own_hidden)
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


def test_forward_over_its_cache_in_chunks_matches_one_pass(checkpoint: tuple) -> None:
    """Rows computed over KV cached by an earlier call (chunked prefill, then one-row decodes)
    equal the reference over the whole sequence: the MTP layer reads its own cache."""
    _, tensors, path = checkpoint
    target = load_dormant(path)
    draft = load_draft(target, path)
    prompt = PROMPTS[1]
    _, _, hidden = run_target(target, nan_caches(target), [prompt])
    tokens = torch.tensor([*prompt[1:], 7])
    for layer, cache in zip(draft.attention_layers(), nan_caches(draft), strict=True):
        layer.kv_cache = cache
    tables = block_tables(1)
    pieces, done = [], 0
    for size in (4, 3, 1, 1, 1):
        seq_len = torch.tensor([done + size])
        meta = build_attention_metadata(tables, seq_len, torch.tensor([size]), BLOCK_SIZE)
        rows = slice(done, done + size)
        with forward_context(meta), torch.no_grad():
            out = draft(tokens[rows], torch.arange(done, done + size), hidden[rows])
        pieces.append(draft.compute_logits(out))
        done += size
    expected = reference_mtp(tensors, 0, target.config, tokens, hidden)
    torch.testing.assert_close(torch.cat(pieces), expected, rtol=1e-4, atol=1e-4)


def test_a_refit_of_the_target_embedding_reaches_the_draft(checkpoint: tuple) -> None:
    _, tensors, path = checkpoint
    target = load_dormant(path)
    draft = load_draft(target, path)
    prompt = PROMPTS[0]
    tokens = torch.tensor([*prompt[1:], 7])

    def draft_logits() -> Tensor:
        _, positions, hidden = run_target(target, nan_caches(target), [prompt])
        for layer, cache in zip(draft.attention_layers(), nan_caches(draft), strict=True):
            layer.kv_cache = cache
        lens = torch.tensor([len(prompt)])
        meta = build_attention_metadata(block_tables(1), lens, lens, BLOCK_SIZE)
        with forward_context(meta), torch.no_grad():
            return draft.compute_logits(draft(tokens, positions, hidden))

    before = draft_logits()
    embedding = tensors["model.embed_tokens.weight"]
    target.load_weights([("model.embed_tokens.weight", embedding.flip(0))])
    changed = draft_logits()
    assert not torch.allclose(before, changed)
    target.load_weights([("model.embed_tokens.weight", embedding)])
    torch.testing.assert_close(draft_logits(), before)
