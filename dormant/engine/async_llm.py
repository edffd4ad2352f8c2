"""``AsyncLLM``: vLLM's async engine shape over one ``LLM``, driven by one loop thread.

    engine = AsyncLLM("path/to/hf-dir", enable_sleep_mode=True)
    async for output in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        ...                                   # cumulative RequestOutputs (or deltas)
    await engine.pause_generation(mode="keep")  # or "abort" / "wait"
    await engine.sleep(level=1)
    await engine.wake_up()
    await engine.resume_generation()            # the kept requests continue

The engine is not thread-safe, so only the loop thread touches it. Every other call is a
*command* run by the loop between two steps, never during one; after running commands the loop
decides again whether it may step, so a sleep queued behind a step never meets a step.

What the loop does between steps, as a table::

    state                                   loop
    ──────────────────────────────────────  ───────────────────────────────────────────────
    no unfinished request, or engine         block until a command arrives
    paused / asleep / weights stale
    requests runnable                       run queued commands, then one step, then
                                            deliver finished outputs and progress
    gate closed (a ``wait`` pause, sleep     new requests are held, not added; the loop
    or refit draining)                      steps until every request finished, then the
                                            command that closed the gate runs and opens it

A refit (``update_weights``, ``reload_weights``, ...) never mixes weight versions in one
completion: by ``refit_policy`` it waits for the running requests to finish (``"wait"``, the
default) or aborts them (``"abort"``). A request that is paused or kept asleep with tokens
already generated cannot be drained, so a refit aborts it in both policies; kept requests with
no output yet simply run on the new weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dormant.core.errors import EngineAsleepError, EngineDeadError, UnsupportedOptionError
from dormant.core.sampling_params import RequestOutputKind, SamplingParams
from dormant.engine.llm import LLM
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import RequestOutput

Prompt = str | Sequence[int] | Mapping[str, Any]
Listener = Callable[[RequestOutput | BaseException], None]
REFIT_POLICIES = ("wait", "abort")
_REPLACEMENT = "\ufffd"
_DRAIN_POLL_S = 0.01


class _Deferred:
    """A command's return value meaning "its future is resolved later" (a held request)."""


_DEFERRED = _Deferred()


@dataclasses.dataclass
class _Tracked:
    user_id: str
    listener: Listener
    wants_progress: bool
    engine_id: Any = None  # what the engine's add_request returned
    num_tokens_sent: int = 0


class AsyncLLM:
    """An engine for asyncio callers. ``AsyncLLM(model, **options)`` takes ``LLM``'s options,
    plus ``refit_policy`` (``"wait"`` or ``"abort"``; see the module docstring)."""

    def __init__(
        self, model: str | Path | Any, *, refit_policy: str = "wait", **options: Any
    ) -> None:
        if refit_policy not in REFIT_POLICIES:
            raise ValueError(f"refit_policy must be one of {REFIT_POLICIES}, got {refit_policy!r}")
        self.refit_policy = refit_policy
        self.llm = model if isinstance(model, LLM) else LLM(model, **options)
        self.engine: LLMEngine = self.llm.llm_engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._tracked: dict[str, _Tracked] = {}  # str(engine request id) → who listens
        self._user_ids: dict[str, str] = {}
        self._cancelled: set[str] = set()  # ids aborted before their held add ran
        self._is_gate_closed = False
        self._held: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._drain_waiters: list[Future[None]] = []
        self._is_stopped = False
        self._stop_lock = threading.Lock()
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="dormant-tokenize")
        self._thread = threading.Thread(target=self._run, name="dormant-async-llm", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: Any = None, **options: Any) -> AsyncLLM:
        """vLLM's constructor: ``engine_args`` is a mapping or an object whose attributes are
        options (vLLM's ``AsyncEngineArgs``), with ``model``; ``options`` override it."""
        if engine_args is None:
            fields: dict[str, Any] = {}
        elif isinstance(engine_args, Mapping):
            fields = dict(engine_args)
        elif dataclasses.is_dataclass(engine_args) and not isinstance(engine_args, type):
            fields = dataclasses.asdict(engine_args)
        else:
            fields = dict(vars(engine_args))
        fields.update(options)
        if "model" not in fields:
            raise TypeError("from_engine_args needs a model (engine_args.model or model=...)")
        return cls(fields.pop("model"), **fields)

    # ── generation ───────────────────────────────────────────────────────────────────────────

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        output_kind: RequestOutputKind | None = None,
        lora_request: Any = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finished; cancelling the consuming task (or
        closing the generator) aborts it. ``output_kind`` defaults to
        ``sampling_params.output_kind`` where it exists, else CUMULATIVE. Raises
        ``EngineAsleepError`` while memory is asleep; while only paused, the request waits.

        ``lora_request`` and ``priority`` are vLLM's (verl passes ``lora_request=None,
        priority=0``): dormant has no LoRA adapters and schedules first come, first served, so
        anything else raises ``UnsupportedOptionError`` before the request is queued."""
        _check_vllm_request_options(lora_request, priority)
        params = sampling_params or SamplingParams()
        kind = output_kind if output_kind is not None else _kind_of(params)
        user_id = request_id if request_id is not None else uuid.uuid4().hex
        items: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def listener(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(items.put_nowait, item)

        request = await self._prepare(prompt, params)
        tracked = _Tracked(user_id, listener, kind is not RequestOutputKind.FINAL_ONLY)
        finished = is_added = False
        sent: list[tuple[int, str, int]] = []  # per completion: tokens, text, logprobs sent
        try:
            await self._call(lambda: self._add(request, tracked), holdable=True)
            is_added = True
            while not finished:
                item = await items.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                output = dataclasses.replace(item, request_id=user_id)
                if kind is RequestOutputKind.DELTA:
                    output = _delta(output, sent, is_first=not sent)
                yield output
        except BaseException as error:
            if not is_added and not isinstance(error, asyncio.CancelledError):
                finished = True  # refused when added: there is nothing to abort
            raise
        finally:
            if not finished:  # cancelled or closed: no awaiting here, just queue the abort
                self._submit(lambda: self._abort_users([user_id]))

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests by the ids given to ``generate``; their streams end with an
        output whose finish_reason is "abort". Unknown ids are ignored (they may have just
        finished)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._call(lambda: self._abort_users(ids))

    # ── sleep, pause, refit ──────────────────────────────────────────────────────────────────

    async def sleep(
        self, level: int = 1, mode: str = "abort", release_context: bool = False
    ) -> None:
        """``LLM.sleep`` between two steps. ``wait`` drains the running requests through the
        loop (their streams keep flowing) before memory sleeps."""
        await self._settled(
            mode, lambda: self._deliver(self.engine.sleep(level, mode, release_context))
        )

    async def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Wakes ``tags`` (all when None); returns whether the engine is fully awake. Kept
        requests continue by themselves once nothing they need is asleep."""
        return await self._call(lambda: self.engine.wake_up(tags))

    async def release(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's ``release_memory_occupation``: running requests are kept."""
        await self._call(lambda: self.engine.release(tags))

    async def is_sleeping(self) -> bool:
        return await self._call(self.engine.is_sleeping)

    async def pause_generation(self, mode: str = "abort") -> None:
        """vLLM's ``pause_generation``: ``abort`` finishes running requests, ``wait`` lets them
        finish first, ``keep`` freezes them until ``resume_generation``. New requests wait."""
        await self._settled(mode, lambda: self._deliver(self.engine.pause(mode)))

    async def resume_generation(self) -> None:
        await self._call(self.engine.resume)

    async def reset_prefix_cache(self) -> bool:
        """vLLM's name: drops the cached KV blocks between two steps. Never needed: the engine
        drops them itself whenever a weight is written or KV memory is discarded."""
        reset = getattr(self.llm, "reset_prefix_cache", None)
        return True if reset is None else bool(await self._call(reset))

    async def reset_mm_cache(self) -> None:
        """vLLM's (verl calls it once the engine is up). dormant serves text-only models, so
        there is no multimodal cache to clear."""

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """vLLM's: returns once no request is running or waiting (new requests are not held
        back meanwhile); raises ``TimeoutError`` after ``drain_timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        while await self._call(lambda: self.engine.has_unfinished_requests() or bool(self._held)):
            if loop.time() >= deadline:
                raise TimeoutError(
                    f"requests were still running after {drain_timeout} s; abort them "
                    "(abort / pause_generation(mode='abort')) or wait longer"
                )
            await asyncio.sleep(_DRAIN_POLL_S)

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """``LLM.collective_rpc`` between two steps, with vLLM's ``AsyncLLM`` signature
        (``timeout`` second; accepted for vLLM's callers, the executor bounds commands); one
        result per rank. Refits through it (``reload_weights``, ``update_weights``) follow
        ``refit_policy``."""
        call = lambda: self.engine.collective_rpc(method, args, kwargs, timeout)  # noqa: E731
        if method in ("reload_weights", "update_weights"):
            return await self.refit(call)
        if method == "sleep":  # the engine's sleep, so that the requests it aborts are answered
            return await self._call(lambda: self._sleep_rpc(args, kwargs or {}))
        return await self._call(call)

    async def update_weights(
        self, weights: Any, *, policy: str | None = None, weight_version: str | None = None
    ) -> None:
        """``LLM.update_weights`` under ``refit_policy`` (or ``policy``)."""
        write = lambda: self.llm.update_weights(weights)  # noqa: E731
        await self.refit(write, policy=policy, weight_version=weight_version)

    async def reload_weights(
        self,
        path: str | None = None,
        *,
        policy: str | None = None,
        weight_version: str | None = None,
    ) -> None:
        """``LLM.reload_weights`` (from ``path``, default the checkpoint) under the policy."""
        write = lambda: self.llm.reload_weights(path)  # noqa: E731
        await self.refit(write, policy=policy, weight_version=weight_version)

    async def refit(
        self,
        write: Callable[[], Any],
        *,
        policy: str | None = None,
        weight_version: str | None = None,
    ) -> Any:
        """Runs ``write`` (anything that changes weights) on the loop once no request could
        mix versions: ``policy`` (default ``refit_policy``) ``"wait"`` drains the running
        requests first, ``"abort"`` aborts them. Sets ``weight_version`` when given."""
        policy = policy or self.refit_policy
        if policy not in REFIT_POLICIES:
            raise ValueError(f"refit policy must be one of {REFIT_POLICIES}, got {policy!r}")

        def apply() -> Any:
            self._abort_engine_ids(self._ids_with_tokens() if policy == "wait" else None)
            result = write()
            if weight_version is not None:
                self.engine.refits.weight_version = weight_version
            return result

        return await self._settled(policy, apply)

    # ── state, for servers and metrics ───────────────────────────────────────────────────────

    @property
    def weight_version(self) -> str:
        """The served weights' version: the engine's one record (``LLM.get_weight_version``)."""
        return self.engine.refits.weight_version

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer (``dormant.engine.tokenizer.Tokenizer``), or None."""
        return self.engine.tokenizer

    @property
    def device(self) -> str:
        """The device the weights live on ("cuda" or "cpu")."""
        device = str(self.engine.config.device)
        if device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return device

    @property
    def max_model_len(self) -> int:
        return int(self.engine.config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.config.model_config.vocab_size)

    @property
    def num_requests(self) -> int:
        """Requests being generated or held (read without the loop: an instant's count)."""
        return len(self._tracked) + len(self._held)

    @property
    def output_processor(self) -> RequestCounts:
        """vLLM's ``AsyncLLM.output_processor``, for its request counts (OpenRLHF balances
        prompts over its engines by ``get_num_unfinished_requests()``)."""
        return RequestCounts(self)

    async def asleep_tags(self) -> tuple[str, ...]:
        """Tags asleep (or in between) on any rank."""
        return await self._call(lambda: self.engine.sleep_control.asleep_tags)

    async def memory_status(self) -> list[Any]:
        return await self._call(self.llm.memory_status)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on the loop thread between two steps (for calls this class does not
        wrap); returns its result or raises its error."""
        return await self._call(fn)

    def shutdown(self) -> None:
        """Stops the loop (running requests get ``EngineDeadError``) and the engine."""
        if not self._is_stopped:
            self._submit(self._stop)
            self._thread.join()
            self._tokenize_pool.shutdown(wait=False)
            self.llm.shutdown()

    # ── the loop thread ──────────────────────────────────────────────────────────────────────

    def _run(self) -> None:
        while not self._is_stopped:
            self._resolve_drain_waiters()  # before blocking: a drain may just have ended
            self._run_commands(block=not self._can_step())
            self._resolve_drain_waiters()
            if self._is_stopped or not self._can_step():  # decided again, after the commands
                continue
            try:
                finished = self.engine.step()
            except BaseException as error:  # fail the requests instead of retrying forever
                self.engine.abort_request()
                self._fail_all(error)
                continue
            self._deliver(finished)
            self._send_progress()
        self._drain_commands_after_stop()

    def _can_step(self) -> bool:
        if not self.engine.has_unfinished_requests():
            return False
        try:
            self.engine.check_can_generate()
        except EngineAsleepError:
            return False
        return True

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            self._run_command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_command(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        try:
            result = fn()
        except BaseException as error:
            future.set_exception(error)
            return
        if result is not _DEFERRED:
            future.set_result(result)

    async def _prepare(self, prompt: Prompt, params: SamplingParams) -> Any:
        """Tokenizes and validates off the loop thread (a long prompt never stalls a step)
        where the engine splits that out (``make_request_input``); raises on a bad request."""
        make = getattr(self.engine, "make_request_input", None)
        if make is None:
            return (_engine_prompt(prompt), params)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, make, prompt, params)

    def _add(self, request: Any, tracked: _Tracked) -> Any:
        if tracked.user_id in self._cancelled:  # aborted while it was held
            self._cancelled.discard(tracked.user_id)
            raise asyncio.CancelledError(f"request {tracked.user_id!r} was aborted")
        if tracked.user_id in self._user_ids:
            raise ValueError(f"request id {tracked.user_id!r} is already in flight")
        control = self.engine.sleep_control
        if not (control.is_paused and control.is_fully_awake):  # a pause only: it waits
            self.engine.check_can_generate()
        if isinstance(request, tuple):
            tracked.engine_id = self.engine.add_request(*request)
        else:
            tracked.engine_id = self.engine.add_request_input(request)
        self._tracked[str(tracked.engine_id)] = tracked
        self._user_ids[tracked.user_id] = str(tracked.engine_id)
        return tracked.engine_id

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        for output in outputs:
            tracked = self._tracked.pop(str(output.request_id), None)
            if tracked is not None:
                self._user_ids.pop(tracked.user_id, None)
                tracked.listener(output)

    def _send_progress(self) -> None:
        for tracked in self._tracked.values():
            if not tracked.wants_progress:
                continue
            output = self.engine.request_output(tracked.engine_id)
            if output is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            if num_tokens > tracked.num_tokens_sent:
                tracked.num_tokens_sent = num_tokens
                tracked.listener(output)

    def _abort_engine_ids(self, engine_ids: Iterable[Any] | None) -> None:
        """Aborts (all when None) and answers them; an empty list aborts nothing."""
        ids = None if engine_ids is None else list(engine_ids)
        if ids is None or ids:
            self._deliver(self.engine.abort_request(ids))

    def _abort_users(self, user_ids: Sequence[str]) -> None:
        """Aborts by the callers' ids; one still held behind the gate is dropped there."""
        keys = [self._user_ids[i] for i in user_ids if i in self._user_ids]
        self._abort_engine_ids([self._tracked[k].engine_id for k in keys])
        self._cancelled.update(i for i in user_ids if i not in self._user_ids)

    def _ids_with_tokens(self) -> list[Any]:
        """Requests that already generated tokens (the ones a refit would mix)."""
        ids = []
        for tracked in self._tracked.values():
            output = self.engine.request_output(tracked.engine_id)
            if output is not None and any(c.token_ids for c in output.outputs):
                ids.append(tracked.engine_id)
        return ids

    def _sleep_rpc(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        self._deliver(self.engine.sleep(*args, **kwargs))
        return list(self.engine.sleep_control.ranks)  # what collective_rpc("sleep") returns

    def _fail_all(self, error: BaseException) -> None:
        for tracked in self._tracked.values():
            tracked.listener(error)
        self._tracked.clear()
        self._user_ids.clear()

    # ── the gate: draining before a wait-mode sleep, pause or refit ──────────────────────────

    async def _settled(self, mode: str, command: Callable[[], Any]) -> Any:
        """Runs ``command`` on the loop; for ``mode == "wait"`` first closes the gate (new
        requests are held) and lets the loop finish every runnable request."""
        if mode != "wait":
            return await self._call(command)
        drained: Future[None] = Future()
        await self._call(lambda: self._close_gate(drained))
        try:
            await asyncio.wrap_future(drained)
            return await self._call(command)
        finally:
            await self._call(self._open_gate)

    def _close_gate(self, drained: Future[None]) -> None:
        self._is_gate_closed = True
        self._drain_waiters.append(drained)

    def _open_gate(self) -> None:
        if self._drain_waiters:  # another drain is still waiting: it opens the gate
            return
        self._is_gate_closed = False
        held, self._held = self._held, []
        for command in held:
            self._run_command(*command)

    def _resolve_drain_waiters(self) -> None:
        """Drained: nothing left that the loop could step (paused or asleep requests stay)."""
        if self._drain_waiters and not self._can_step():
            waiters, self._drain_waiters = self._drain_waiters, []
            for waiter in waiters:
                waiter.set_result(None)

    # ── commands from other threads ──────────────────────────────────────────────────────────

    async def _call(self, fn: Callable[[], Any], *, holdable: bool = False) -> Any:
        future: Future[Any] = Future()
        if holdable:  # held while the gate is closed; run when it opens
            inner = fn

            def fn() -> Any:
                if self._is_gate_closed:
                    self._held.append((inner, future))
                    return _DEFERRED
                return inner()

        return await asyncio.wrap_future(self._submit(fn, future))

    def _submit(self, fn: Callable[[], Any], future: Future[Any] | None = None) -> Future[Any]:
        future = future or Future()
        with self._stop_lock:
            if self._is_stopped:
                future.set_exception(EngineDeadError("the engine was shut down"))
                return future
            self._commands.put((fn, future))
        return future

    def _stop(self) -> None:
        with self._stop_lock:
            self._is_stopped = True
        self.engine.abort_request()
        self._fail_all(EngineDeadError("the engine was shut down"))
        for _, future in self._held:
            future.set_exception(EngineDeadError("the engine was shut down"))
        self._held.clear()

    def _drain_commands_after_stop(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(EngineDeadError("the engine was shut down"))


def _check_vllm_request_options(lora_request: Any, priority: int) -> None:
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


class RequestCounts:
    """What vLLM's ``OutputProcessor`` tells about unfinished requests: here, the requests
    an ``AsyncLLM`` is generating or holding (``num_requests``)."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine

    def get_num_unfinished_requests(self) -> int:
        return self._engine.num_requests

    def has_unfinished_requests(self) -> bool:
        return self._engine.num_requests > 0


def _kind_of(params: SamplingParams) -> RequestOutputKind:
    return RequestOutputKind(int(params.output_kind))


def _engine_prompt(prompt: Prompt) -> str | list[int]:
    """Text, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return str(prompt["prompt"])
    return list(prompt)


def _delta(
    output: RequestOutput, sent: list[tuple[int, str, int]], *, is_first: bool
) -> RequestOutput:
    """What is new in ``output`` since ``sent`` (updated in place), as a RequestOutput."""
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
