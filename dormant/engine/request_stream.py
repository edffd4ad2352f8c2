"""One ``AsyncLLM.generate`` call's stream: ``stream_outputs`` adds the request through the
loop, yields its outputs until it finished, and aborts it when the caller stops listening.
Around it: the prompt forms vLLM's callers pass, the vLLM request options dormant refuses, and
the delta view of cumulative outputs (``RequestOutputKind.DELTA``).

All of it runs on the caller's asyncio task; the loop thread only calls the listener, which
hands each item to the task's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, NoReturn

from dormant.core.errors import EngineDeadError, EngineGenerateError, UnsupportedOptionError
from dormant.core.sampling_params import RequestOutputKind, SamplingParams
from dormant.engine.engine_loop import EngineLoop
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import RequestOutput
from dormant.engine.request_tracker import RequestTracker, TrackedRequest

Prompt = str | Sequence[int] | Mapping[str, Any]
# What a delta stream has sent so far, per completion: tokens, text, logprobs.
SentCounts = list[tuple[int, str, int]]
_REPLACEMENT = "\ufffd"


async def stream_outputs(
    engine_loop: EngineLoop,
    requests: RequestTracker,
    request: Any,
    user_id: str,
    kind: RequestOutputKind,
) -> AsyncGenerator[RequestOutput, None]:
    """Adds ``request`` (held while the loop's gate is closed) and yields its outputs, named
    ``user_id``, until one is finished. Errors are vLLM's (``AsyncLLM.generate``): a refused
    add raises its own error, and so does ``EngineDeadError``; any other error handed over
    while the request ran (a failed step) raises ``EngineGenerateError`` caused by it, and the
    request is aborted. Closed or cancelled before that, it aborts the request without
    awaiting (this may run in a generator's finalizer): at once if its add has not run, else by
    a queued abort. A request refused when added needs no abort; one whose id is pending
    already raises ``DuplicateRequestIdError`` before anything is queued."""
    newest = Newest()
    loop = asyncio.get_running_loop()

    def listener(item: RequestOutput | BaseException) -> None:
        # The caller's event loop may close with the request running (``asyncio.run``
        # returned): nobody listens then, and the request runs out or its queued abort ends
        # it. Raising here would stop the loop thread, and every other caller with it.
        with contextlib.suppress(RuntimeError):  # "Event loop is closed"
            loop.call_soon_threadsafe(newest.put, item)

    tracked = TrackedRequest(user_id, listener, kind is not RequestOutputKind.FINAL_ONLY)
    finished = is_added = False
    sent: SentCounts = []
    requests.expect(tracked)  # raises for an id already pending, recording nothing
    try:
        await engine_loop.call(lambda: requests.add(request, tracked), holdable=True)
        is_added = True
        while not finished:
            item = await newest.get()
            if isinstance(item, BaseException):
                raise_handed_error(item, user_id)  # ``finally`` aborts it unless the engine died
            finished = item.finished
            output = dataclasses.replace(item, request_id=user_id)
            if kind is RequestOutputKind.DELTA:
                output = delta_output(output, sent, is_first=not sent)
            yield output
    except BaseException as error:
        if not is_added and not isinstance(error, asyncio.CancelledError):
            finished = True  # refused when added: there is nothing to abort
        raise
    finally:
        if finished and not is_added:
            requests.forget(tracked)  # refused, or the loop never ran the add
        # Cancelled or closed: a pending request is aborted here and now (its id is free at
        # once); a running one's abort is queued (no awaiting in a ``finally``).
        if not finished and not requests.cancel_pending(tracked):
            engine_loop.submit(lambda: requests.abort_tracked(tracked))


def raise_handed_error(error: BaseException, user_id: str) -> NoReturn:
    """Raises an error the loop handed to ``user_id``'s stream as vLLM's ``generate`` does:
    ``EngineDeadError`` as it is, any other exception as ``EngineGenerateError`` caused by it."""
    if isinstance(error, EngineDeadError) or not isinstance(error, Exception):
        raise error
    raise EngineGenerateError(
        f"request {user_id!r} failed while the engine ran it ({error!r}); it was aborted and "
        "the engine still serves other requests: submit it again, or shut the engine down if "
        "this repeats"
    ) from error


class Newest:
    """The newest item of one stream that its reader has not taken yet. Outputs are cumulative,
    so a newer one makes an unread older one redundant: a slow reader holds one output, not one
    per step (each a copy of the prompt and the tokens so far), as vLLM's
    ``RequestOutputCollector`` merges them. The last item (an error, or the finished output) is
    never replaced. On the caller's loop."""

    def __init__(self) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._is_ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        last = self._item
        if not (isinstance(last, BaseException) or (last is not None and last.finished)):
            self._item = item
        self._is_ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._is_ready.wait()
        self._is_ready.clear()
        item, self._item = self._item, None
        assert item is not None
        return item


def check_vllm_request_options(lora_request: Any, priority: int) -> None:
    """Raises ``UnsupportedOptionError`` for a LoRA adapter or a non-zero priority."""
    if lora_request is not None:
        raise UnsupportedOptionError(
            "lora_request: dormant has no LoRA adapters; merge the adapter into the weights, "
            "refit, and pass lora_request=None"
        )
    if priority != 0:
        raise UnsupportedOptionError(
            f"priority={priority!r}: dormant schedules first come, first served "
            "(scheduling_policy='fcfs'); pass priority=0"
        )


async def prepare_request(
    engine: LLMEngine, pool: Executor, prompt: Prompt, params: SamplingParams
) -> Any:
    """Tokenizes and validates on ``pool``, off the loop thread (a long prompt never stalls a
    step), where the engine splits that out (``make_request_input``); raises on a bad request.
    Otherwise returns ``(prompt, params)`` for ``add_request``."""
    make = getattr(engine, "make_request_input", None)
    if make is None:
        return (engine_prompt(prompt), params)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, make, prompt, params)


def output_kind_of(params: SamplingParams) -> RequestOutputKind:
    return RequestOutputKind(int(params.output_kind))


def engine_prompt(prompt: Prompt) -> str | list[int]:
    """Text, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return str(prompt["prompt"])
    return list(prompt)


def delta_output(output: RequestOutput, sent: SentCounts, *, is_first: bool) -> RequestOutput:
    """What is new in ``output`` since ``sent`` (updated in place), as a RequestOutput. Text
    that may end in an incomplete character is held back until the character completes."""
    while len(sent) < len(output.outputs):
        sent.append((0, "", 0))
    completions = []
    for completion in output.outputs:
        num_tokens, text, num_logprobs = sent[completion.index]
        new_text = completion.text
        if not completion.finished():  # a character may still be incomplete
            new_text = new_text.rstrip(_REPLACEMENT)
        delta = new_text[len(text) :] if new_text.startswith(text) else ""
        logprobs = completion.logprobs
        sent[completion.index] = (
            len(completion.token_ids),
            text + delta,
            len(logprobs) if logprobs is not None else 0,
        )
        completions.append(
            dataclasses.replace(
                completion,
                text=delta,
                token_ids=list(completion.token_ids[num_tokens:]),
                logprobs=None if logprobs is None else list(logprobs[num_logprobs:]),
            )
        )
    prompt_logprobs = output.prompt_logprobs if is_first else None
    return dataclasses.replace(output, outputs=completions, prompt_logprobs=prompt_logprobs)
