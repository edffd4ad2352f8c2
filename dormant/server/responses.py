"""Reply bodies built from ``RequestOutput``s: OpenAI's completion and chat shapes (with
logprobs), and the per-choice pieces of a stream.

The text is detokenized incrementally by the engine (its output processor feeds each new
token to the tokenizer's ``incremental_decoder``: ``tokenizers``' ``DecodeStream`` for HF fast
tokenizers, UTF-8 bytes for the byte tokenizer, holding back what may still become a stop
string), so a stream only sends what the cumulative text gained; nothing is decoded again."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from dormant.engine.outputs import CompletionOutput, RequestOutput


def choice_index(prompt_index: int, completion: CompletionOutput, n: int) -> int:
    """OpenAI numbers the choices of all prompts in one list: prompt-major, then sample."""
    return prompt_index * n + completion.index


def token_texts(tokenizer: Any, token_ids: Sequence[int], as_ids: bool = False) -> list[str]:
    """Each token's own text (vLLM's ``decoded_token``); "" without a tokenizer. With
    ``as_ids`` (vLLM's ``return_tokens_as_token_ids``), ``"token_id:<id>"`` instead: every
    token named apart, also those whose text is not valid UTF-8 or is another's."""
    if as_ids:
        return [f"token_id:{t}" for t in token_ids]
    return list(tokenizer.decode_each(token_ids)) if tokenizer else [""] * len(token_ids)


def _top(position: dict[int, Any] | None, k: int) -> list[tuple[int, float]]:
    """The top ``k`` (token id, logprob) of one position, most likely first."""
    if not position:
        return []
    ranked = sorted(position.items(), key=lambda item: (item[1].rank or 0, -item[1].logprob))
    return [(t, lp.logprob) for t, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


def completion_logprobs(
    completion: CompletionOutput, k: int, tokenizer: Any, as_ids: bool = False, offset: int = 0
) -> dict[str, Any] | None:
    """``/v1/completions``' ``logprobs`` object for ``completion``'s tokens."""
    if completion.logprobs is None:
        return None
    ids = list(completion.token_ids)
    texts = token_texts(tokenizer, ids, as_ids)
    tops = []
    for position in completion.logprobs:
        top = _top(position, k)
        texts_of_top = token_texts(tokenizer, [t for t, _ in top], as_ids)
        tops.append(dict(zip(texts_of_top, (v for _, v in top), strict=True)))
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [p[t].logprob for t, p in zip(ids, completion.logprobs, strict=True)],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    completion: CompletionOutput, k: int, tokenizer: Any, as_ids: bool = False
) -> dict[str, Any] | None:
    """Chat's ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if completion.logprobs is None:
        return None
    ids = list(completion.token_ids)
    content = []
    for token_id, text, position in zip(
        ids, token_texts(tokenizer, ids, as_ids), completion.logprobs, strict=True
    ):
        top = _top(position, k)
        top_texts = token_texts(tokenizer, [t for t, _ in top], as_ids)
        content.append(
            {
                "token": text,
                "logprob": position[token_id].logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": s, "logprob": v, "bytes": list(s.encode())}
                    for s, (_, v) in zip(top_texts, top, strict=True)
                ],
            }
        )
    return {"content": content}


def prompt_logprobs(output: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` in a reply: per prompt position (None for the first), each
    token id (as a string, JSON's keys) with its ``logprob``, ``rank`` and ``decoded_token``;
    None when the request asked for none."""
    if output.prompt_logprobs is None:
        return None
    return [None if p is None else _logprob_entries(p) for p in output.prompt_logprobs]


def _logprob_entries(position: dict[int, Any]) -> dict[str, dict[str, Any]]:
    return {
        str(token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
        for token_id, e in position.items()
    }


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(request_id: str, kind: str, model: str, choices: list[Any]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


class TextStream:
    """One choice's new text and token ids since the last output (outputs are cumulative)."""

    def __init__(self) -> None:
        self.sent = ""
        self.num_tokens = 0

    def advance(self, completion: CompletionOutput) -> tuple[str, list[int]]:
        new_ids = list(completion.token_ids[self.num_tokens :])
        self.num_tokens = len(completion.token_ids)
        text = completion.text
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta, new_ids
