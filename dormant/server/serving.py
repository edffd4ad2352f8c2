"""What every generation route shares: the model-name check, prompt checks made before the
engine sees anything (length before tokenization, tokenization off the engine thread, token
ids against the vocabulary, ``max_tokens`` against the context), auto-wake, and running or
streaming several prompts as one request (all or none: a refusal cancels the rest)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from dormant.core.sampling_params import SamplingParams
from dormant.engine.async_llm import AsyncLLM
from dormant.engine.outputs import RequestOutput
from dormant.server.errors import BadRequestError, ClientGoneError, NotServedError
from dormant.server.metrics import Metrics
from dormant.server.settings import MAX_CHARS_PER_TOKEN, ServerSettings

PromptIn = str | list[int]
T = TypeVar("T")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there


@dataclass(frozen=True)
class Prepared:
    """A prompt checked and tokenized: what the engine will be given."""

    token_ids: list[int]
    text: str | None


class Serving:
    """Shared by the OpenAI and SGLang routes; talks only to ``AsyncLLM``."""

    def __init__(self, engine: AsyncLLM, settings: ServerSettings, metrics: Metrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.max_prompt_chars = settings.max_prompt_chars or (
            self.max_model_len * MAX_CHARS_PER_TOKEN
        )
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="dormant-http-tokenize")
        self.last_activity = time.monotonic()
        self.num_in_flight = 0
        self._running_ids: set[str] = set()  # engine ids of open generations, for ``abort``

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.served_model_names:
            raise NotServedError(
                f"the model {name!r} is not served here; served: "
                f"{list(self.settings.served_model_names)} (see /v1/models)",
                kind="NotFoundError",
            )

    # ── prompts ──────────────────────────────────────────────────────────────────────────────

    def check_batch(self, num_prompts: int, n: int) -> None:
        """Refuses, before any prompt is tokenized, a request that would start more sequences
        than ``max_sequences_per_request``: every other client's requests would wait behind
        them."""
        limit = self.settings.max_sequences_per_request
        if num_prompts * n > limit:
            raise BadRequestError(
                f"the request starts {num_prompts} prompts x n={n} = {num_prompts * n} "
                f"sequences, more than this server accepts in one request ({limit}, "
                "--max-sequences-per-request); send them in smaller requests"
            )

    async def prepare(self, prompt: PromptIn, add_special_tokens: bool = True) -> Prepared:
        """Checks ``prompt`` (text is measured before it is tokenized, on a tokenizer thread);
        raises BadRequestError with what was wrong."""
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise BadRequestError(
                    f"the prompt has {len(prompt)} characters, more than this server accepts "
                    f"({self.max_prompt_chars}); the context holds {self.max_model_len} tokens"
                )
            tokenizer = self.tokenizer()
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(
                self._tokenize_pool, lambda: tokenizer.encode(prompt, add_special_tokens)
            )
            return self.check_ids(list(ids), prompt)
        return self.check_ids(list(prompt), None)

    def check_ids(self, token_ids: Sequence[int], text: str | None) -> Prepared:
        if not token_ids:
            raise BadRequestError("the prompt is empty; give at least one token")
        bad = [(i, t) for i, t in enumerate(token_ids) if not 0 <= t < self.vocab_size]
        if bad:
            where = ", ".join(f"{t} at position {i}" for i, t in bad[:3])
            raise BadRequestError(
                f"token ids must be in [0, {self.vocab_size}) (the vocabulary); got {where}"
            )
        if len(token_ids) >= self.max_model_len:
            raise BadRequestError(
                f"the prompt has {len(token_ids)} tokens; this model's maximum context length "
                f"is {self.max_model_len} tokens (max_model_len), leaving none to generate"
            )
        return Prepared(list(token_ids), text)

    def max_tokens(self, prompts: Sequence[Prepared], requested: int | None) -> int:
        """vLLM's rule: ``requested`` must fit beside the longest prompt; None means all the
        room that is left."""
        longest = max(len(p.token_ids) for p in prompts)
        room = self.max_model_len - longest
        if requested is None:
            return room
        if requested > room:
            raise BadRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {longest + requested} tokens ({longest} in the prompt, "
                f"{requested} for the completion). Lower max_tokens or the prompt"
            )
        return requested

    async def chat_prompt(
        self, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None
    ) -> Prepared:
        """The chat's prompt through the model's template (``template_kwargs``: vLLM's
        ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``)."""
        if len(messages) >= self.max_model_len:  # a template spends a token on each, at least
            raise BadRequestError(
                f"{len(messages)} messages cannot fit: the context holds {self.max_model_len} "
                "tokens, and each message takes at least one"
            )
        num_chars = sum(len(m.get("content", "")) + len(m.get("name") or "") for m in messages)
        if num_chars > self.max_prompt_chars:
            raise BadRequestError(
                f"the messages have {num_chars} characters, more than this server accepts "
                f"({self.max_prompt_chars}); the context holds {self.max_model_len} tokens"
            )
        tokenizer = self.tokenizer()
        loop = asyncio.get_running_loop()
        render = functools.partial(tokenizer.apply_chat_template, **(template_kwargs or {}))
        ids = await loop.run_in_executor(self._tokenize_pool, render, messages)
        return self.check_ids(ids, None)

    def tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise BadRequestError(
                "this server has no tokenizer (skip_tokenizer_init): give prompts as token ids"
            )
        return tokenizer

    # ── generation ───────────────────────────────────────────────────────────────────────────

    async def ensure_awake(self) -> None:
        """With ``auto_wake``, a request arriving while asleep wakes the engine (refused
        when the weights were discarded: they need a refit first)."""
        if not self.settings.auto_wake or not await self.engine.is_sleeping():
            return
        await self.engine.wake_up()
        self.metrics.wakes.inc()

    async def streams(
        self, prompts: Sequence[Prepared], params: SamplingParams, request_id: str
    ) -> list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]:
        """Starts every prompt and waits for each one's first output, so that a refusal
        (asleep, invalid) raises here, before any reply is sent; closes them all on error."""
        await self.ensure_awake()
        generators: list[Any] = [
            self._generate(p, params, request_id, f"{request_id}-{i}").__aiter__()
            for i, p in enumerate(prompts)
        ]
        firsts = await asyncio.gather(*(g.__anext__() for g in generators), return_exceptions=True)
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            await asyncio.gather(*(g.aclose() for g in generators), return_exceptions=True)
            raise errors[0]
        return list(zip(firsts, generators, strict=True))  # type: ignore[arg-type]

    async def _generate(
        self, prompt: Prepared, params: SamplingParams, request_id: str, engine_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The engine's stream, with ``engine_id`` listed for ``abort`` while it is open."""
        if engine_id in self._running_ids:
            raise BadRequestError(
                f"a running request already has the id {request_id!r}; give each request its "
                "own rid (or none: the server makes one)"
            )
        self._running_ids.add(engine_id)
        try:
            prompt_in = {"prompt_token_ids": prompt.token_ids}
            stream: Any = self.engine.generate(prompt_in, params, engine_id)  # a generator
            async with contextlib.aclosing(stream):  # closing it aborts the request at once
                async for output in stream:
                    yield output
        finally:
            self._running_ids.discard(engine_id)

    async def abort(self, request_id: str | None) -> None:
        """Aborts the requests started under ``request_id`` (every request when None); they
        answer with what they generated so far and finish_reason "abort". An id that is not
        running (it may have just finished) changes nothing."""
        ids = [i for i in self._running_ids if request_id in (None, i.rpartition("-")[0])]
        await self.engine.abort(ids)

    async def run(
        self,
        prompts: Sequence[Prepared],
        params: SamplingParams,
        request_id: str,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> list[RequestOutput]:
        """The final output of every prompt, in order. A reply is sent only at the end, so
        ``is_disconnected`` (the request's) is asked every ``DISCONNECT_POLL_S`` meanwhile: a
        client that left has its requests aborted (``ClientGoneError``), rather than their
        sequences run to their last token for nobody."""
        with self.metrics.track_request(self):
            started = await self.streams(prompts, params, request_id)

            async def last(first: RequestOutput, rest: AsyncIterator[RequestOutput]):
                output = first
                async for output in rest:  # noqa: B007
                    pass
                return output

            tasks = [asyncio.ensure_future(last(f, r)) for f, r in started]
            try:
                outputs = await _unless_gone(asyncio.gather(*tasks), is_disconnected)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
            self.metrics.count_outputs(outputs)
            return list(outputs)

    async def merged(
        self, started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as each stream produces them; cancelling the
        consumer cancels (and so aborts) every stream. A slow consumer gets each stream's newest
        output (it holds all of the older ones), so at most one waits per stream."""
        newest: dict[int, RequestOutput] = {}  # per stream, its newest output not yet taken
        # An index: newest[index] is ready; (index, error), (index, None): the stream ended.
        items: asyncio.Queue[int | tuple[int, BaseException | None]] = asyncio.Queue()

        def put(index: int, output: RequestOutput) -> None:
            if index not in newest:
                items.put_nowait(index)
            newest[index] = output

        async def pump(index: int, first: RequestOutput, rest: AsyncIterator[RequestOutput]):
            put(index, first)
            try:
                async for output in rest:
                    put(index, output)
            except BaseException as error:
                items.put_nowait((index, error))
            items.put_nowait((index, None))

        with self.metrics.track_request(self):
            tasks = [asyncio.ensure_future(pump(i, f, r)) for i, (f, r) in enumerate(started)]
            num_open = len(tasks)
            finals: list[RequestOutput] = []
            try:
                while num_open:
                    ready = await items.get()
                    if isinstance(ready, tuple):
                        if ready[1] is not None:
                            raise ready[1]
                        num_open -= 1
                        continue
                    index, item = ready, newest.pop(ready)
                    if item.finished:
                        finals.append(item)
                    yield index, item
                self.metrics.count_outputs(finals)
            finally:
                for task in tasks:
                    task.cancel()


async def _unless_gone(
    work: Awaitable[T], is_disconnected: Callable[[], Awaitable[bool]] | None
) -> T:
    """``await work``, raising ``ClientGoneError`` (``work`` cancelled) once the client left."""
    future = asyncio.ensure_future(work)
    if is_disconnected is None:
        return await future
    while True:
        done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
        if done:
            return future.result()
        if await is_disconnected():
            future.cancel()
            raise ClientGoneError("the client closed its connection; its requests were aborted")
