"""The OpenAI-compatible request bodies: validated into (prompts, SamplingParams), and the
response bodies built from ``RequestOutput``s.

Strict, like the rest of dormant: a field this server does not know is refused, and so is a
known OpenAI field set to a value it cannot honour (``n > 1``, ``logprobs``, penalties, string
``stop``s). Refusing is better than silently generating something else. ``stream`` (with
``stream_options.include_usage``) is supported. vLLM's extensions are accepted: ``top_k``,
``seed``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dormant.core.sampling_params import SamplingParams
from dormant.engine.outputs import RequestOutput


class BadRequestError(ValueError):
    """The request body is malformed or asks for something this server does not do."""


_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"}
_COMMON_FIELDS = {"model", "max_tokens", "return_token_ids", "user", "stream", "stream_options"}
_COMMON_FIELDS |= _SAMPLING_FIELDS
# Known OpenAI fields, accepted only at the value that means "off".
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (False,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "stop": (None, [], ""),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
COMPLETION_FIELDS = {"prompt", *_COMMON_FIELDS, *_OFF_VALUES}
CHAT_FIELDS = {"messages", "max_completion_tokens", *_COMMON_FIELDS, *_OFF_VALUES} - {
    "echo",
    "suffix",
    "best_of",
}

Prompt = str | list[int]


@dataclass(frozen=True)
class Options:
    """How to answer: token ids in the reply, streamed as server-sent events, a usage chunk at
    the end of a stream."""

    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[Prompt]
    params: SamplingParams
    options: Options


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    params: SamplingParams
    options: Options


def parse_completion(body: Any) -> CompletionRequest:
    """``/v1/completions``: ``prompt`` is a string, a list of token ids, or a list of either."""
    fields = _check_fields(body, COMPLETION_FIELDS, required=("prompt",))
    return CompletionRequest(
        _prompts(fields["prompt"]), _params(fields, "max_tokens", 16), _options(fields)
    )


def parse_chat(body: Any, default_max_tokens: int) -> ChatRequest:
    """``/v1/chat/completions``: the messages (each a role and string content). The prompt is
    the tokenizer's chat template. Without ``max_completion_tokens``/``max_tokens`` a reply may
    run to ``default_max_tokens`` (the engine stops every sequence at ``max_model_len``)."""
    fields = _check_fields(body, CHAT_FIELDS, required=("messages",))
    messages = fields["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list")
    for message in messages:
        if not isinstance(message, Mapping) or set(message) - {"role", "content", "name"}:
            raise BadRequestError(f"each message has a role and a content, got {message!r}")
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise BadRequestError(f"role and content must be strings (text only), got {message!r}")
    key = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    params = _params(fields, key, default_max_tokens)
    return ChatRequest([dict(m) for m in messages], params, _options(fields))


def completion_response(
    outputs: Sequence[RequestOutput], model: str, return_token_ids: bool
) -> dict[str, Any]:
    choices = []
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        choice: dict[str, Any] = {
            "index": index,
            "text": completion.text,
            "logprobs": None,
            "finish_reason": completion.finish_reason,
        }
        if return_token_ids:
            choice["prompt_token_ids"] = list(output.prompt_token_ids)
            choice["token_ids"] = list(completion.token_ids)
        choices.append(choice)
    return _envelope("cmpl", "text_completion", outputs, model, choices)


def chat_response(output: RequestOutput, model: str, return_token_ids: bool) -> dict[str, Any]:
    completion = output.outputs[0]
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": None,
        "finish_reason": completion.finish_reason,
    }
    if return_token_ids:
        choice["token_ids"] = list(completion.token_ids)
    response = _envelope("chatcmpl", "chat.completion", [output], model, [choice])
    if return_token_ids:
        response["prompt_token_ids"] = list(output.prompt_token_ids)
    return response


def _envelope(
    prefix: str, kind: str, outputs: Sequence[RequestOutput], model: str, choices: list[Any]
) -> dict[str, Any]:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "id": f"{prefix}-{outputs[0].request_id}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _check_fields(body: Any, allowed: set[str], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequestError(f"unknown field(s) {unknown}; this server accepts {sorted(allowed)}")
    missing = [name for name in required if name not in body]
    if missing:
        raise BadRequestError(f"missing required field(s) {missing}")
    for name, off in _OFF_VALUES.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in off):
            raise BadRequestError(
                f"{name}={body[name]!r} is not supported by this server (only {off[0]!r})"
            )
    return body


def _prompts(prompt: Any) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise BadRequestError(
        "prompt must be a string, a non-empty list of token ids, or a non-empty list of either"
    )


def _params(fields: Mapping[str, Any], max_tokens_key: str, default: int) -> SamplingParams:
    options = {name: fields[name] for name in _SAMPLING_FIELDS if fields.get(name) is not None}
    if options.get("top_k") == -1:  # vLLM's spelling of "off"
        del options["top_k"]
    max_tokens = fields.get(max_tokens_key)
    options["max_tokens"] = default if max_tokens is None else max_tokens
    try:
        return SamplingParams(**options)
    except (TypeError, ValueError) as error:
        raise BadRequestError(str(error)) from error


def _options(fields: Mapping[str, Any]) -> Options:
    stream_options = fields.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise BadRequestError(f"stream_options may only hold include_usage, got {stream_options!r}")
    flags = {
        "return_token_ids": fields.get("return_token_ids", False),
        "stream": fields.get("stream", False),
        "include_usage": stream_options.get("include_usage", False),
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise BadRequestError(f"{name} must be a bool, got {value!r}")
    if flags["include_usage"] and not flags["stream"]:
        raise BadRequestError("stream_options is only allowed with stream=true")
    return Options(**flags)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
