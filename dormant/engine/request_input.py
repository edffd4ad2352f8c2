"""A request as the engine keeps it: its prompt tokenized and its own validated copy of the
sampling parameters, made before anything is queued so that a refused request changes nothing.

The copy is normalised as vLLM's ``SamplingParams.__post_init__`` and processor do: ``seed=-1``
means unseeded, ``logprobs=True`` means 1, a positive temperature below 0.01 becomes 0.01, and
``bad_words`` are tokenized (``bad_words_token_ids``) with vLLM's rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dormant.core.errors import InvalidSamplingParamsError, UnsupportedOptionError
from dormant.core.sampling_params import (
    GREEDY_TEMPERATURE_EPSILON,
    MIN_RANDOM_TEMPERATURE,
    SamplingParams,
)
from dormant.engine.scheduler import RequestTooLongError
from dormant.engine.tokenizer import Tokenizer

Prompt = str | Sequence[int] | Mapping[str, Any]


@dataclass(frozen=True)
class RequestInput:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int


def make_request_input(
    prompt: Prompt, params: SamplingParams, tokenizer: Tokenizer | None, limits: RequestLimits
) -> RequestInput:
    """Tokenizes ``prompt`` (text, token ids, or vLLM's ``{"prompt_token_ids": [...]}`` /
    ``{"prompt": "..."}``) and validates a copy of ``params`` against the engine's limits.

    Raises ``InvalidSamplingParamsError`` / ``UnsupportedSamplingParamsError`` for bad
    parameters, ``RequestTooLongError`` for a prompt over ``max_model_len``, ``ValueError``
    for a malformed prompt. Pure: nothing is queued.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    text, token_ids = _tokenize(prompt, tokenizer)
    own = params.clone()
    own.validate(max_logprobs=limits.max_logprobs, vocab_size=limits.vocab_size)
    _normalise(own)
    if tokenizer is None and (own.stop_strings or own.bad_words):
        raise InvalidSamplingParamsError(
            "stop strings and bad_words need a tokenizer; this engine was built with "
            "skip_tokenizer_init=True: use stop_token_ids instead"
        )
    if own.bad_words and tokenizer is not None:
        own._bad_words_token_ids = bad_words_token_ids(own.bad_words, tokenizer)
    bad = [t for t in token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})"
        )
    if not token_ids:
        raise ValueError("the prompt is empty; pass at least one token (e.g. BOS)")
    if len(token_ids) > limits.max_model_len:
        raise RequestTooLongError(
            f"the prompt has {len(token_ids)} tokens, more than max_model_len="
            f"{limits.max_model_len}; shorten it or build the LLM with a larger max_model_len"
        )
    return RequestInput(text, token_ids, own)


def bad_words_token_ids(words: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """vLLM's ``update_from_tokenizer``: each word as tokens, and again with a leading space
    when that gives a different first token and the same length (so it is banned both at the
    start of the text and after a space)."""
    result: list[list[int]] = []
    for word in dict.fromkeys(words):
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                if not prefix:
                    raise InvalidSamplingParamsError(
                        f"bad word {word!r} tokenizes to no tokens; remove it"
                    )
                continue
            if not prefix or (ids[0] != result[-1][0] and len(ids) == len(result[-1])):
                result.append(ids)
    return result


def _normalise(params: SamplingParams) -> None:
    if params.seed == -1:
        params.seed = None
    if params.logprobs is True:
        params.logprobs = 1
    if params.prompt_logprobs is True:
        params.prompt_logprobs = 1
    if GREEDY_TEMPERATURE_EPSILON <= params.temperature < MIN_RANDOM_TEMPERATURE:
        params.temperature = MIN_RANDOM_TEMPERATURE


def _tokenize(prompt: Prompt, tokenizer: Tokenizer | None) -> tuple[str | None, list[int]]:
    if isinstance(prompt, Mapping):
        if prompt.get("multi_modal_data"):
            raise UnsupportedOptionError(
                "multi_modal_data: dormant serves text-only models; pass token ids alone"
            )
        # An empty multi_modal_data is what verl sends with every text prompt.
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise ValueError(
                f"prompt dict keys {sorted(unknown)} are not supported; use 'prompt_token_ids' "
                "(vLLM's TokensPrompt) or 'prompt' (TextPrompt)"
            )
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            return (None if text is None else str(text)), _token_ids(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        prompt = str(prompt["prompt"])
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "this engine has no tokenizer (skip_tokenizer_init=True): give prompts as "
                "token ids, e.g. {'prompt_token_ids': [...]}"
            )
        return prompt, tokenizer.encode(prompt)
    return None, _token_ids(prompt)


def _token_ids(ids: Any) -> list[int]:
    token_ids = list(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise ValueError(f"prompt token ids must be ints, got {token_ids[:5]!r}...")
    return token_ids
