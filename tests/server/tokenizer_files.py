"""A small byte-level BPE tokenizer (``tokenizers``), saved as a Hugging Face fast tokenizer
with a chat template, for checkpoints of the tiny test models (vocabulary 512)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<eos>", "<|user|>", "<|assistant|>", "<|system|>"]


def write_tokenizer(path: Path) -> None:
    """Writes a tokenizer of 256 byte tokens, a few merges and the special tokens (ids < 300)
    into ``path``: multi-byte characters span several tokens, as in real vocabularies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["hello world, the engine sleeps and wakes"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
