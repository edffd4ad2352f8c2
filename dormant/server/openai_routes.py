"""OpenAI's routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) and vLLM's
``/tokenize`` / ``/detokenize``. Streams are server-sent events in OpenAI's chunk format,
ending with ``data: [DONE]``; a stream's pieces add up to the non-streamed reply."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.sse import EventSourceResponse, format_sse_event

from dormant.core.sampling_params import SamplingParams
from dormant.engine.outputs import RequestOutput
from dormant.server import responses as r
from dormant.server.errors import BadRequestError
from dormant.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
)
from dormant.server.serving import Prepared, Serving

router = APIRouter()


def serving_of(request: Request) -> Serving:
    return request.app.state.serving


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    serving = serving_of(request)
    created = request.app.state.started_at
    cards = [
        ModelCard(id=name, created=created, root=name, max_model_len=serving.max_model_len)
        for name in serving.settings.served_model_names
    ]
    return ModelList(data=cards)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    serving = serving_of(request)
    serving.check_model(body.model)
    prompt = body.prompt
    items = prompt if isinstance(prompt, list) and prompt and not _is_ids(prompt) else [prompt]
    serving.check_batch(len(items), body.n)
    prompts = [await serving.prepare(p) for p in items]  # type: ignore[arg-type]
    defaults = request.app.state.sampling_defaults
    max_tokens = _max_tokens(serving, prompts, body.max_tokens, defaults)
    params = body.sampling_params(max_tokens, body.logprobs, defaults)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    job = _Job(serving, body, params, prompts, request_id, is_chat=False, k=body.logprobs or 0)
    if body.stream:
        return await job.stream()
    outputs = await serving.run(prompts, params, request_id, request.is_disconnected)
    return job.reply(outputs)


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request) -> Any:
    serving = serving_of(request)
    serving.check_model(body.model)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        template_kwargs = body.template_kwargs()
    except ValueError as error:
        raise BadRequestError(str(error)) from error
    prompts = [await serving.chat_prompt(messages, template_kwargs)]
    requested = body.max_completion_tokens or body.max_tokens
    k = body.top_logprobs or 0
    defaults = request.app.state.sampling_defaults
    max_tokens = _max_tokens(serving, prompts, requested, defaults)
    params = body.sampling_params(max_tokens, k if body.logprobs else None, defaults)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    job = _Job(serving, body, params, prompts, request_id, is_chat=True, k=k)
    if body.stream:
        return await job.stream()
    return job.reply(await serving.run(prompts, params, request_id, request.is_disconnected))


def _max_tokens(
    serving: Serving, prompts: list[Prepared], requested: int | None, defaults: dict[str, Any]
) -> int:
    """vLLM's ``get_max_tokens``: what the request asks for (it must fit), else the model's
    default ``max_new_tokens`` within the room the longest prompt leaves, else all that room."""
    room = serving.max_tokens(prompts, requested)
    if requested is None and "max_tokens" in defaults:
        return min(room, defaults["max_tokens"])
    return room


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    serving = serving_of(request)
    serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequestError("give exactly one of prompt or messages")
    if body.messages is not None:
        prepared = await serving.chat_prompt(
            [m.model_dump(exclude_none=True) for m in body.messages]
        )
    else:
        prepared = await serving.prepare(body.prompt or "", body.add_special_tokens)
    return {
        "count": len(prepared.token_ids),
        "max_model_len": serving.max_model_len,
        "tokens": prepared.token_ids,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    serving = serving_of(request)
    serving.check_model(body.model)
    serving.check_ids(body.tokens or [0], None)
    return {"prompt": serving.tokenizer().decode(body.tokens)}


def _is_ids(prompt: list[Any]) -> bool:
    return all(isinstance(t, int) for t in prompt)


class _Job:
    """One completion or chat request: its reply, whole or streamed."""

    def __init__(
        self,
        serving: Serving,
        body: SamplingFields,
        params: SamplingParams,
        prompts: list[Prepared],
        request_id: str,
        *,
        is_chat: bool,
        k: int,
    ) -> None:
        self.serving, self.body, self.params, self.prompts = serving, body, params, prompts
        self.request_id, self.is_chat, self.k = request_id, is_chat, k
        self.tokenizer = serving.engine.tokenizer
        self.model = serving.model_name

    def reply(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for p, output in enumerate(outputs):
            for completion in output.outputs:
                choice: dict[str, Any] = {
                    "index": r.choice_index(p, completion, self.params.n),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "logprobs": self._logprobs(completion),
                }
                if self.is_chat:
                    choice["message"] = {"role": "assistant", "content": completion.text}
                else:
                    choice["text"] = completion.text
                    if self.body.return_token_ids:
                        choice["prompt_token_ids"] = list(output.prompt_token_ids)
                    if self.params.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = r.prompt_logprobs(output)
                if self.body.return_token_ids:
                    choice["token_ids"] = list(completion.token_ids)
                choices.append(choice)
        kind = "chat.completion" if self.is_chat else "text_completion"
        reply = r.envelope(self.request_id, kind, self.model, choices)
        reply["usage"] = r.usage(outputs)
        if self.is_chat and self.body.return_token_ids:
            reply["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
        if self.is_chat and self.params.prompt_logprobs is not None:
            reply["prompt_logprobs"] = r.prompt_logprobs(outputs[0])
        return reply

    def _logprobs(self, completion: Any) -> dict[str, Any] | None:
        as_ids = self.body.return_tokens_as_token_ids
        if self.is_chat:
            return r.chat_logprobs(completion, self.k, self.tokenizer, as_ids)
        return r.completion_logprobs(completion, self.k, self.tokenizer, as_ids)

    async def stream(self) -> EventSourceResponse:
        """Starts the stream (a refusal raises here, as a plain error reply)."""
        started = await self.serving.streams(self.prompts, self.params, self.request_id)
        return EventSourceResponse(self._events(started), headers={"Cache-Control": "no-cache"})

    async def _events(self, started: Any) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        texts: dict[int, r.TextStream] = {}
        finals: list[RequestOutput] = []
        try:
            async for p, output in self.serving.merged(started):
                for completion in output.outputs:
                    index = r.choice_index(p, completion, self.params.n)
                    if index not in texts:
                        texts[index] = r.TextStream()
                        if self.is_chat:
                            first = {"index": index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}  # fmt: skip
                            yield _event(r.envelope(self.request_id, kind, self.model, [first]))
                    chunk = self._piece(texts[index], index, completion)
                    if chunk is not None:
                        yield _event(r.envelope(self.request_id, kind, self.model, [chunk]))
                if output.finished:
                    finals.append(output)
        except Exception as error:  # the stream has started: the error is its last event
            from dormant.server.errors import error_body, status_of

            yield _event(error_body(str(error), type(error).__name__, status_of(error)))
        else:
            options = self.body.stream_options
            if options is not None and options.include_usage:
                tail = r.envelope(self.request_id, kind, self.model, [])
                tail["usage"] = r.usage(finals)
                yield _event(tail)
        yield format_sse_event(data_str="[DONE]")

    def _piece(self, text: r.TextStream, index: int, completion: Any) -> dict[str, Any] | None:
        num_before = text.num_tokens
        delta, token_ids = text.advance(completion)
        if not token_ids and not delta and not completion.finished():
            return None
        choice: dict[str, Any] = {"index": index}
        choice.update({"delta": {"content": delta}} if self.is_chat else {"text": delta})
        logprobs = None
        if completion.logprobs is not None:
            part = type(completion)(
                index=completion.index,
                text=delta,
                token_ids=token_ids,
                cumulative_logprob=None,
                logprobs=list(completion.logprobs[num_before : num_before + len(token_ids)]),
            )
            logprobs = self._logprobs(part)
        choice["logprobs"] = logprobs
        choice["finish_reason"] = completion.finish_reason
        choice["stop_reason"] = completion.stop_reason
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
        return choice


def _event(payload: Any) -> bytes:
    return format_sse_event(data_str=json.dumps(payload))
