"""Fixtures for the worker tests: a tiny Qwen3 checkpoint, its Hugging Face model, and one CPU
worker (host backend) built from the same checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from worker_setup import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, VOCAB_SIZE

from dormant.core.config import EngineConfig
from dormant.worker.worker import Worker


@pytest.fixture(scope="session")
def hf_model_and_path(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen3ForCausalLM, Path]:
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=False,
        torch_dtype="float32",
        eos_token_id=VOCAB_SIZE - 1,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="module")
def worker(hf_model_and_path: tuple[Qwen3ForCausalLM, Path]) -> Iterator[Worker]:
    """A loaded CPU worker with ``NUM_BLOCKS`` KV blocks (one per process at a time: the
    host device has one memory manager)."""
    config = EngineConfig.create(
        hf_model_and_path[1],
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    worker = Worker(config)
    try:
        worker.load_model()
        worker.init_kv_cache(NUM_BLOCKS)
        yield worker
    finally:
        worker.shutdown()
