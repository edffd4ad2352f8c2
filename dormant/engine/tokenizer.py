"""Text <-> token ids: a Hugging Face tokenizer from a model directory, or a byte fallback."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

_NUM_BYTE_IDS = 256
# Any one of these in a model directory means it ships a tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)
_GENERATION_CONFIG_FILE = "generation_config.json"


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded, or does not fit the model's vocabulary."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer. Every id it produces is ``< vocab_size``."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Iterable[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids of a chat, ending with the assistant's turn; ``TokenizerError`` if
        the tokenizer has no chat template."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids ``0..255``, BOS ``256`` and EOS ``257``; for models without one.

    ``encode`` adds no special tokens. ``decode`` drops ids that are not bytes (special
    tokens, or ids a model with a larger vocabulary sampled) and replaces invalid UTF-8.
    """

    bos_token_id: int = _NUM_BYTE_IDS
    eos_token_id: int = _NUM_BYTE_IDS + 1
    vocab_size: int = _NUM_BYTE_IDS + 2

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.eos_token_id})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Iterable[int]) -> str:
        data = bytes(t for t in token_ids if 0 <= t < _NUM_BYTE_IDS)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        raise TokenizerError(
            "this model has no tokenizer (bytes stand in for one), so no chat template; "
            "use /v1/completions with a prompt"
        )


class HFTokenizer:
    """A ``transformers`` tokenizer loaded from a local directory; never downloads.

    EOS ids are the tokenizer's EOS plus those of ``generation_config.json`` when the
    directory has one (chat models often stop on several tokens). ``encode`` adds the
    tokenizer's usual special tokens (e.g. BOS); ``decode`` skips special tokens.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as error:
            raise TokenizerError(f"cannot load a tokenizer from {path!r}: {error}") from error
        eos_ids = set(_generation_config_eos_ids(path))
        if self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_token_ids = frozenset(eos_ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._tokenizer.bos_token_id

    @property
    def vocab_size(self) -> int:
        """All ids the tokenizer knows, added tokens included."""
        return len(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, token_ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self._tokenizer, "chat_template", None):
            raise TokenizerError(
                "the model's tokenizer has no chat template; use /v1/completions with a prompt"
            )
        ids = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def has_tokenizer_files(model_dir: str) -> bool:
    """Whether ``model_dir`` contains any of the files a HF tokenizer is loaded from."""
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in _TOKENIZER_FILES)


def load_tokenizer(model_dir: str | None, vocab_size: int) -> Tokenizer:
    """The HF tokenizer of ``model_dir`` if it has one, else a ``ByteTokenizer``.

    ``vocab_size`` is the model's; raises ``TokenizerError`` if the tokenizer could emit an
    id the model does not have, and ``FileNotFoundError`` if ``model_dir`` is not a directory.
    """
    if model_dir is not None and not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
    tokenizer: Tokenizer
    if model_dir is not None and has_tokenizer_files(model_dir):
        tokenizer = HFTokenizer(model_dir)
    else:
        tokenizer = ByteTokenizer()
    if tokenizer.vocab_size > vocab_size:
        raise TokenizerError(
            f"{type(tokenizer).__name__} has {tokenizer.vocab_size} ids but the model's "
            f"vocabulary has only {vocab_size}; use a model with vocab_size >= "
            f"{tokenizer.vocab_size} or a matching tokenizer"
        )
    return tokenizer


def _generation_config_eos_ids(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, _GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as file:
        config: dict[str, Any] = json.load(file)
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(i) for i in eos]
