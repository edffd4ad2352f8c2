"""Text <-> token ids: a Hugging Face tokenizer, a byte stand-in for random models, or none.

Which one an engine gets (``load_tokenizer``), never guessed for a real checkpoint:

| model                                        | tokenizer                                   |
|----------------------------------------------|---------------------------------------------|
| ``skip_tokenizer_init=True``                 | none: prompts are token ids, outputs no text |
| ``tokenizer=`` given                         | the HF tokenizer of that directory          |
| a checkpoint directory (``load_format`` auto) | its HF tokenizer; missing files raise        |
| a random model (``ModelConfig``, or "dummy") | the directory's HF tokenizer if it has one, |
|                                              | else ``ByteTokenizer``                      |

Each tokenizer's ``incremental_decoder`` (an output's text as its tokens arrive) is one of
``incremental_decoding.py``'s decoders.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from dormant.core.generation_config import GENERATION_CONFIG_FILE
from dormant.engine.incremental_decoding import (
    NUM_BYTE_IDS,
    ByteDecoder,
    FullDecodeDiff,
    IncrementalDecoder,
    primed_stream_decoder,
)
from dormant.errors import EngineError

# Any one of these in a model directory means it ships a tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)
# Each byte id's own text, as ``ByteTokenizer.decode([id])`` makes it (a lone byte past ASCII
# is invalid UTF-8: the replacement character).
_BYTE_TEXTS = tuple(bytes([b]).decode("utf-8", errors="replace") for b in range(NUM_BYTE_IDS))


class TokenizerError(EngineError, ValueError):
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def decode_each(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's own text, special tokens included (vLLM's ``decoded_token``)."""
        ...

    def incremental_decoder(
        self, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> IncrementalDecoder:
        """A decoder for the output that follows ``prompt_token_ids``."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], **template_kwargs: Any
    ) -> list[int]:
        """The prompt ids of a chat, ending with the assistant's turn unless
        ``template_kwargs`` say otherwise (``add_generation_prompt``, ``continue_final_message``,
        and what the template itself reads, e.g. ``enable_thinking``); ``TokenizerError`` if
        the tokenizer has no chat template."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids ``0..255``, BOS ``256`` and EOS ``257``; for models without one.

    ``encode`` adds no special tokens. ``decode`` drops ids that are not bytes (special
    tokens, or ids a model with a larger vocabulary sampled) and replaces invalid UTF-8.
    """

    bos_token_id: int = NUM_BYTE_IDS
    eos_token_id: int = NUM_BYTE_IDS + 1
    vocab_size: int = NUM_BYTE_IDS + 2

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.eos_token_id})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t for t in token_ids if 0 <= t < NUM_BYTE_IDS)
        return data.decode("utf-8", errors="replace")

    def decode_each(self, token_ids: Sequence[int]) -> list[str]:
        texts = _BYTE_TEXTS
        return [texts[t] if 0 <= t < NUM_BYTE_IDS else "" for t in token_ids]

    def incremental_decoder(
        self, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> IncrementalDecoder:
        return ByteDecoder()

    def apply_chat_template(
        self, messages: list[dict[str, str]], **template_kwargs: Any
    ) -> list[int]:
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

    def __init__(self, path: str, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as error:
            raise TokenizerError(f"cannot load a tokenizer from {path!r}: {error}") from error
        eos_ids = set(_generation_config_eos_ids(path))
        if self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_token_ids = frozenset(eos_ids)
        self._texts: dict[int, str] = {}  # decode_each's cache: one entry per id ever decoded

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

    @property
    def hf_tokenizer(self) -> Any:
        """The ``transformers`` tokenizer itself (what ``LLM.get_tokenizer`` returns)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def decode_each(self, token_ids: Sequence[int]) -> list[str]:
        texts = self._texts
        missing = list(dict.fromkeys(t for t in token_ids if t not in texts))
        if missing:  # one batched call for the ids never seen before
            decoded = self._tokenizer.batch_decode([[t] for t in missing])
            texts.update(zip(missing, decoded, strict=True))
        return [texts[t] for t in token_ids]

    def incremental_decoder(
        self, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> IncrementalDecoder:
        backend = getattr(self._tokenizer, "_tokenizer", None)  # a fast tokenizer's own
        if backend is None:
            return FullDecodeDiff(self, skip_special_tokens)
        return primed_stream_decoder(backend, prompt_token_ids, skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], **template_kwargs: Any
    ) -> list[int]:
        if not getattr(self._tokenizer, "chat_template", None):
            raise TokenizerError(
                "the model's tokenizer has no chat template; use /v1/completions with a prompt"
            )
        options = {"add_generation_prompt": True, **template_kwargs}
        ids = self._tokenizer.apply_chat_template(messages, tokenize=True, **options)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def has_tokenizer_files(model_dir: str) -> bool:
    """Whether ``model_dir`` contains any of the files a HF tokenizer is loaded from."""
    return any(os.path.isfile(os.path.join(model_dir, name)) for name in _TOKENIZER_FILES)


def load_tokenizer(
    model_dir: str | None,
    vocab_size: int,
    *,
    tokenizer_dir: str | None = None,
    is_random_model: bool = False,
    skip_tokenizer_init: bool = False,
    trust_remote_code: bool = False,
) -> Tokenizer | None:
    """The engine's tokenizer, chosen as the module's table says (None when skipped).

    ``vocab_size`` is the model's; raises ``TokenizerError`` if the tokenizer could emit an
    id the model does not have, or if a checkpoint ships no tokenizer, and
    ``FileNotFoundError`` if a directory named does not exist.
    """
    if skip_tokenizer_init:
        return None
    for path in (model_dir, tokenizer_dir):
        if path is not None and not os.path.isdir(path):
            raise FileNotFoundError(f"directory {path!r} does not exist")
    tokenizer: Tokenizer
    if tokenizer_dir is not None:
        tokenizer = HFTokenizer(tokenizer_dir, trust_remote_code)
    elif model_dir is not None and (not is_random_model or has_tokenizer_files(model_dir)):
        if not has_tokenizer_files(model_dir):
            raise TokenizerError(
                f"the checkpoint {model_dir!r} has no tokenizer files "
                f"({', '.join(_TOKENIZER_FILES)}). Pass tokenizer='<dir>', or "
                "skip_tokenizer_init=True to give prompts as "
                "token ids and get outputs without text"
            )
        tokenizer = HFTokenizer(model_dir, trust_remote_code)
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
    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as file:
        config: dict[str, Any] = json.load(file)
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(i) for i in eos]
