"""End-to-end equality with Hugging Face ``transformers``: prefill logits and 32-step greedy
decoding through the paged KV cache, for every family (Qwen3-MoE with and without dense
layers among the sparse ones)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import (
    PagedRunner,
    hf_greedy,
    llama_gqa_config,
    load_dormant,
    make_hf_model,
    qwen2_config,
    qwen3_config,
    qwen3_moe_config,
    qwen3_moe_mixed_config,
    save_checkpoint,
)
from transformers import PretrainedConfig, PreTrainedModel

NUM_DECODE_STEPS = 32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPTS = [[5, 17, 42, 99, 7], [1, 200, 3, 64, 128, 9, 33, 250, 11]]
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama_gqa_llama3_rope": llama_gqa_config,
    "qwen2_qkv_bias": qwen2_config,
    "qwen3_tied": lambda: qwen3_config(tie_word_embeddings=True),
    "qwen3_untied": lambda: qwen3_config(tie_word_embeddings=False),
    "qwen3_moe": qwen3_moe_config,
    "qwen3_moe_dense_layer_tied": qwen3_moe_mixed_config,
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    hf_model = make_hf_model(CONFIGS[request.param](), seed=0)
    path = save_checkpoint(hf_model, tmp_path_factory.mktemp(request.param))
    return hf_model, path


def _hf_logits(hf_model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt]), use_cache=False).logits[0].float()


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_logits_match_hf(checkpoint: tuple[PreTrainedModel, Path], device: str) -> None:
    hf_model, path = checkpoint
    model = load_dormant(path, device=device)
    runner = PagedRunner(model, num_seqs=2, max_seq_len=16, block_size=4)
    logits = runner.step(PROMPTS)
    for prompt, ours in zip(PROMPTS, logits, strict=True):
        reference = _hf_logits(hf_model, prompt)
        torch.testing.assert_close(ours.cpu(), reference, rtol=1e-4, atol=1e-5)


def test_prefill_over_cached_prefix_matches_hf(checkpoint: tuple[PreTrainedModel, Path]) -> None:
    """Chunked prefill: the second chunk attends to a prefix already in the KV cache."""
    hf_model, path = checkpoint
    model = load_dormant(path)
    runner = PagedRunner(model, num_seqs=2, max_seq_len=16, block_size=4)
    first = runner.step([prompt[:3] for prompt in PROMPTS])
    second = runner.step([prompt[3:] for prompt in PROMPTS])
    for i, prompt in enumerate(PROMPTS):
        ours = torch.cat([first[i], second[i]])
        torch.testing.assert_close(ours, _hf_logits(hf_model, prompt), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_decode_matches_hf(checkpoint: tuple[PreTrainedModel, Path], device: str) -> None:
    hf_model, path = checkpoint
    model = load_dormant(path, device=device)
    max_len = max(map(len, PROMPTS)) + NUM_DECODE_STEPS
    runner = PagedRunner(model, num_seqs=len(PROMPTS), max_seq_len=max_len, block_size=4)
    last_logits = [logits[-1] for logits in runner.step(PROMPTS)]
    generated: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(NUM_DECODE_STEPS):
        next_tokens = [int(logits.argmax()) for logits in last_logits]
        for tokens, token in zip(generated, next_tokens, strict=True):
            tokens.append(token)
        last_logits = [logits[-1] for logits in runner.step([[t] for t in next_tokens])]
    for prompt, tokens in zip(PROMPTS, generated, strict=True):
        assert tokens == hf_greedy(hf_model, prompt, NUM_DECODE_STEPS)


def test_bf16_logits_close_to_hf(checkpoint: tuple[PreTrainedModel, Path]) -> None:
    hf_model, path = checkpoint
    hf_bf16 = make_hf_model(hf_model.config, seed=0)
    hf_bf16.load_state_dict(hf_model.state_dict())
    hf_bf16 = hf_bf16.to(torch.bfloat16)
    model = load_dormant(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    runner = PagedRunner(model, num_seqs=2, max_seq_len=16, block_size=4)
    for prompt, ours in zip(PROMPTS, runner.step(PROMPTS), strict=True):
        reference = _hf_logits(hf_bf16, prompt)
        scale = float(reference.abs().max())
        torch.testing.assert_close(ours, reference, rtol=0.0, atol=0.03 * scale)
        exact = _hf_logits(hf_model, prompt)
        hf_error = float((reference - exact).abs().max())  # HF's own bf16 against fp32
        torch.testing.assert_close(ours, exact, rtol=0.0, atol=max(0.03 * scale, 1.5 * hf_error))


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf_model = make_hf_model(llama_gqa_config(), seed=1)
    path = save_checkpoint(hf_model, tmp_path, max_shard_size="300KB")
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) >= 2 and (path / "model.safetensors.index.json").is_file()
    model = load_dormant(path)
    runner = PagedRunner(model, num_seqs=1, max_seq_len=16, block_size=16)
    (ours,) = runner.step(PROMPTS[:1])
    torch.testing.assert_close(ours, _hf_logits(hf_model, PROMPTS[0]), rtol=1e-4, atol=1e-5)
