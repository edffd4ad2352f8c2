"""Fixtures for engine tests: a tiny Qwen3 (hidden 64, 2 layers), HF checkpoints of it, and
engines on the CPU (host backend) and, on a GPU machine, on CUDA (eager)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dormant import LLM, SamplingParams

ENGINE_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPTS = [[5, 17, 99, 3, 250, 42], [7, 7, 7], [101, 202, 33, 44, 55, 66, 77, 88, 99, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True
)


def hf_config(**overrides: object):
    from transformers import Qwen3Config

    options = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        torch_dtype="float32",
        eos_token_id=511,
        architectures=["Qwen3ForCausalLM"],
    )
    options.update(overrides)
    return Qwen3Config(**options)


def hf_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """The weights of an HF Qwen3 initialised with ``seed`` (HF names, float32)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(hf_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # random norms, so every weight matters
                param.uniform_(0.5, 1.5)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


TOKENIZER_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "hello", "world",
    "stop", "here", "and", "there", "sleep", "wake",
)  # fmt: skip


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (320 ids, EOS ``<|endoftext|>`` = 0) trained on a fixed
    text, saved as a HF fast tokenizer: checkpoints ship one, as real ones do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    words = TOKENIZER_WORDS
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(str(path))


def write_checkpoint(
    path: Path,
    seed: int,
    extra: dict[str, torch.Tensor] | None = None,
    with_tokenizer: bool = True,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    hf_config().save_pretrained(path)
    save_file({**hf_state_dict(seed), **(extra or {})}, str(path / "model.safetensors"))
    if with_tokenizer:
        write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt_a"), seed=1)


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt_b"), seed=2)


@pytest.fixture(params=ENGINE_DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_llm(device: str) -> Iterator[Callable[..., LLM]]:
    """Builds engines on ``device``; shuts them down after the test. One per GPU at a time (a
    process holds one MemoryManager per device): on CUDA, making an engine first shuts down
    the ones made before it, so a test compares against an engine it has finished with."""
    engines: list[LLM] = []

    def make(model: object, **options: object) -> LLM:
        if device == "cuda":
            for earlier in engines:
                earlier.shutdown()
        defaults = dict(
            device=device, max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20, seed=0
        )
        llm = LLM(model, **{**defaults, **options})  # type: ignore[arg-type]
        engines.append(llm)
        return llm

    yield make
    for llm in engines:
        llm.shutdown()


def tokens(outputs: list) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in outputs]


def worker_of(llm: LLM):
    return llm.llm_engine.executor.worker
