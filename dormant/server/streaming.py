"""Streaming replies: server-sent events carrying each request's new text (and token ids) as
the engine produces it, OpenAI's chunk format, ``data: [DONE]`` at the end."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Sequence
from typing import Any

from dormant.core.sampling_params import SamplingParams
from dormant.engine.outputs import RequestOutput
from dormant.server.engine_loop import EngineLoop
from dormant.server.protocol import Options, Prompt

_REPLACEMENT = "\ufffd"  # what a token that ends mid-character decodes to, for now


class Stream:
    """The events of one streaming request (``kind`` ``"completion"`` or ``"chat"``).

    ``open`` queues the prompts (raising, with nothing sent, if the engine refuses them);
    iterating yields one JSON-able chunk per piece of progress, then the usage chunk if asked
    for. ``cancel`` aborts what is still running (the client went away).
    """

    def __init__(self, loop: EngineLoop, kind: str, model: str, options: Options) -> None:
        self.loop, self.kind, self.model, self.options = loop, kind, model, options
        self._events: queue.SimpleQueue[tuple[int, RequestOutput | BaseException]] = (
            queue.SimpleQueue()
        )
        self._ids: list[int] = []
        self._created = int(time.time())

    def open(self, prompts: Sequence[Prompt], params: SamplingParams) -> None:
        listeners = [lambda item, i=i: self._events.put((i, item)) for i in range(len(prompts))]
        self._ids = self.loop.submit(prompts, params, listeners, is_streaming=True)

    def cancel(self) -> None:
        self.loop.abort(self._ids)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        num_open = len(self._ids)
        sent_text = [""] * num_open
        sent_tokens = [0] * num_open
        finals: list[RequestOutput] = []
        if self.kind == "chat":
            yield self._chunk(0, {"delta": {"role": "assistant", "content": ""}}, None)
        while num_open:
            index, item = self._events.get()
            if isinstance(item, BaseException):
                yield {"error": {"message": str(item), "type": type(item).__name__}}
                return
            completion = item.outputs[0]
            text = completion.text
            if not item.finished:  # hold back a character that may still be incomplete
                text = text.rstrip(_REPLACEMENT)
            delta = text[len(sent_text[index]) :] if text.startswith(sent_text[index]) else ""
            sent_text[index] += delta
            token_ids = list(completion.token_ids[sent_tokens[index] :])
            sent_tokens[index] = len(completion.token_ids)
            yield self._delta(index, delta, token_ids, completion.finish_reason)
            if item.finished:
                finals.append(item)
                num_open -= 1
        if self.options.include_usage:
            prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
            completion_tokens = sum(len(o.outputs[0].token_ids) for o in finals)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
            yield {**self._chunk(0, {}, None), "choices": [], "usage": usage}

    def _delta(
        self, index: int, text: str, token_ids: list[int], reason: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = (
            {"text": text} if self.kind == "completion" else {"delta": {"content": text}}
        )
        if self.options.return_token_ids:
            choice["token_ids"] = token_ids
        return self._chunk(index, choice, reason)

    def _chunk(self, index: int, choice: dict[str, Any], reason: str | None) -> dict[str, Any]:
        is_chat = self.kind == "chat"
        return {
            "id": f"{'chatcmpl' if is_chat else 'cmpl'}-{self._ids[0]}",
            "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": self._created,
            "model": self.model,
            "choices": [{"index": index, **choice, "logprobs": None, "finish_reason": reason}],
        }
