"""Text of one output, token by token: what each tokenizer's ``incremental_decoder`` returns.

    decoder           for                                   a character split over tokens
    ────────────────  ────────────────────────────────────  ─────────────────────────────────
    ByteDecoder       ByteTokenizer (ids 0..255 are bytes)  appears with its last byte
    StreamDecoder     a fast HF tokenizer (DecodeStream)    appears once complete
    FullDecodeDiff    a slow HF tokenizer                   held back while the text ends
                                                            in a replacement character

Each ``step(token_id)`` returns only the new text (maybe ""); a decoder holds one output's state
and is used by one request.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

NUM_BYTE_IDS = 256  # ids 0..255 are the bytes themselves (``ByteTokenizer``'s vocabulary)
# vLLM primes a stream with up to this many prompt tokens, the fewest (at least 4) that
# decode without a replacement character, so the first output token gets its leading space.
_MIN_PRIMING_TOKENS, _MAX_PRIMING_TOKENS = 4, 24
REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDecoder(Protocol):
    """Text of one output, token by token: ``step`` returns the new text (maybe "")."""

    def step(self, token_id: int) -> str: ...


class _Decodes(Protocol):
    """What ``FullDecodeDiff`` needs of a tokenizer."""

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


class ByteDecoder:
    """UTF-8 bytes as they arrive; a character split over tokens appears with its last byte."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        if not 0 <= token_id < NUM_BYTE_IDS:
            return ""
        return self._decoder.decode(bytes([token_id]))


class StreamDecoder:
    """``tokenizers``' ``DecodeStream``: None (an unfinished character) becomes ""."""

    def __init__(self, stream: Any, backend: Any) -> None:
        self._stream, self._backend = stream, backend

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


class FullDecodeDiff:
    """For slow tokenizers (no ``DecodeStream``): decodes the whole output each step and
    returns what grew, holding back a trailing replacement character."""

    def __init__(self, tokenizer: _Decodes, skip_special_tokens: bool) -> None:
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self._token_ids: list[int] = []
        self._num_chars = 0

    def step(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        text = self._tokenizer.decode(self._token_ids, skip_special_tokens=self._skip)
        if text.endswith(REPLACEMENT_CHARACTER):
            return ""
        new, self._num_chars = text[self._num_chars :], len(text)
        return new


def primed_stream_decoder(
    backend: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool
) -> StreamDecoder:
    """A ``StreamDecoder`` over a fast tokenizer's ``backend`` (its ``tokenizers.Tokenizer``),
    primed as vLLM primes one: with the shortest proper suffix of the prompt, 4 to 23 tokens
    long, that decodes without a replacement character, else the prompt's last 4 tokens."""
    from tokenizers.decoders import DecodeStream

    prefix = list(prompt_token_ids[-_MIN_PRIMING_TOKENS:])
    for length in range(_MIN_PRIMING_TOKENS, min(len(prompt_token_ids), _MAX_PRIMING_TOKENS)):
        suffix = list(prompt_token_ids[-length:])
        if REPLACEMENT_CHARACTER not in backend.decode(suffix):
            prefix = suffix
            break
    stream = DecodeStream(ids=prefix, skip_special_tokens=skip_special_tokens)
    return StreamDecoder(stream, backend)
