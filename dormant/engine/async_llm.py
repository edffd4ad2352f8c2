"""``AsyncLLM``: vLLM's async engine shape over one ``LLM``, driven by one loop thread.

    engine = AsyncLLM("path/to/hf-dir", enable_sleep_mode=True)
    async for output in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        ...                                   # cumulative RequestOutputs (or deltas)
    await engine.pause_generation(mode="keep")  # or "abort" / "wait"
    await engine.sleep(level=1)
    await engine.wake_up()
    await engine.resume_generation()            # the kept requests continue

This is the facade; the loop thread that runs every call between two steps is
``engine_loop.EngineLoop``, one call's stream ``request_stream``, and who listens to which
request ``request_tracker.RequestTracker``, and what it tells without the loop (state and
health) ``engine_client.EngineClientState``.

A refit (``update_weights``, ``reload_weights``, ...) never mixes weight versions in one
completion: by ``refit_policy`` it waits for the running requests to finish (``"wait"``, the
default) or aborts them (``"abort"``); ``refit_policy.py`` says which requests each aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dormant.core.errors import UnsupportedOptionError
from dormant.core.sampling_params import RequestOutputKind, SamplingParams
from dormant.core.vllm_options import engine_args_fields
from dormant.engine.async_weight_transfer import AsyncWeightTransferCalls
from dormant.engine.engine_client import EngineClientState
from dormant.engine.engine_loop import EngineLoop
from dormant.engine.llm import LLM
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import RequestOutput
from dormant.engine.refit_policy import REFIT_POLICIES, check_refit_policy, refit_between_steps
from dormant.engine.request_stream import (
    Prompt,
    check_vllm_request_options,
    output_kind_of,
    prepare_request,
    stream_outputs,
)
from dormant.engine.request_tracker import Listener, RequestTracker

__all__ = ["REFIT_POLICIES", "AsyncLLM", "Listener", "Prompt", "RequestOutputKind"]

_DRAIN_POLL_S = 0.01


class AsyncLLM(EngineClientState, AsyncWeightTransferCalls):
    """An engine for asyncio callers. ``AsyncLLM(model, **options)`` takes ``LLM``'s options,
    plus ``refit_policy`` (``"wait"`` or ``"abort"``; see the module docstring)."""

    def __init__(
        self, model: str | Path | Any, *, refit_policy: str = "wait", **options: Any
    ) -> None:
        check_refit_policy(refit_policy, "refit_policy")
        self.refit_policy = refit_policy
        self.llm = model if isinstance(model, LLM) else LLM(model, **options)
        self.engine: LLMEngine = self.llm.llm_engine
        self._requests = RequestTracker(self.engine)
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="dormant-tokenize")
        self._engine_loop = EngineLoop(self.engine, self._requests)
        self._is_shut_down = False

    @classmethod
    def from_engine_args(
        cls,
        engine_args: Any = None,
        start_engine_loop: bool = True,
        usage_context: Any = None,
        stat_loggers: Sequence[Any] | None = None,
        **options: Any,
    ) -> AsyncLLM:
        """vLLM's constructor: ``engine_args`` is a mapping or an object whose attributes are
        options (vLLM's ``AsyncEngineArgs``), with ``model``; ``options`` override it. The loop
        always starts, and ``usage_context`` is vLLM's telemetry; ``stat_loggers`` must be
        empty (NeMo-RL passes ``[]``): dormant's metrics are ``get_metrics()`` and ``/metrics``."""
        if stat_loggers:
            raise UnsupportedOptionError(
                f"stat_loggers={list(stat_loggers)!r}: dormant takes no vLLM stat loggers; read "
                "get_metrics() or the server's /metrics, and pass stat_loggers=None (NeMo-RL: "
                "vllm_cfg.enable_vllm_metrics_logger=false)"
            )
        fields = {**engine_args_fields(engine_args), **options}
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
        ``EngineAsleepError`` while memory is asleep (while only paused, the request waits),
        ``DuplicateRequestIdError`` for an id still running, ``EngineGenerateError`` (caused
        by the failure) if the request fails once running, and ``dead_error`` once the engine
        stopped, as vLLM's does.

        ``lora_request`` and ``priority`` are vLLM's (verl passes ``lora_request=None,
        priority=0``): dormant has no LoRA adapters and schedules first come, first served, so
        anything else raises ``UnsupportedOptionError`` before the request is queued."""
        check_vllm_request_options(lora_request, priority)
        if self.errored:
            raise self.dead_error
        params = sampling_params or SamplingParams()
        kind = output_kind if output_kind is not None else output_kind_of(params)
        user_id = request_id if request_id is not None else uuid.uuid4().hex
        request = await prepare_request(self.engine, self._tokenize_pool, prompt, params)
        stream = stream_outputs(self._engine_loop, self._requests, request, user_id, kind)
        # Closing this generator closes the stream now (not when it is collected): that aborts.
        async with contextlib.aclosing(stream):
            async for output in stream:
                yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Aborts requests by the ids given to ``generate``; their streams end with an
        output whose finish_reason is "abort". Unknown ids are ignored (they may have just
        finished)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._engine_loop.call(lambda: self._requests.abort_users(ids))

    # ── sleep, pause, refit ──────────────────────────────────────────────────────────────────

    async def sleep(
        self, level: int = 1, mode: str = "abort", release_context: bool = False
    ) -> None:
        """``LLM.sleep`` between two steps. ``wait`` drains the running requests through the
        loop (their streams keep flowing) before memory sleeps."""
        await self._engine_loop.settled(
            mode,
            lambda: self._requests.deliver(self.engine.sleep(level, mode, release_context)),
        )

    async def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Wakes ``tags`` (all when None); returns whether the engine is fully awake. Kept
        requests continue by themselves once nothing they need is asleep."""
        return await self._engine_loop.call(lambda: self.engine.wake_up(tags))

    async def release(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's ``release_memory_occupation``: running requests are kept."""
        await self._engine_loop.call(lambda: self.engine.release(tags))

    async def is_sleeping(self) -> bool:
        return await self._engine_loop.call(self.engine.is_sleeping)

    async def is_paused(self) -> bool:
        """vLLM's: whether ``pause_generation`` stopped scheduling (until resumed)."""
        return bool(await self._engine_loop.call(lambda: self.engine.sleep_control.is_paused))

    async def pause_generation(
        self,
        mode: str = "abort",
        *,
        wait_for_inflight_requests: bool | None = None,
        clear_cache: bool = True,
    ) -> None:
        """vLLM's ``pause_generation``: ``abort`` finishes running requests, ``wait`` lets them
        finish first, ``keep`` freezes them until ``resume_generation``. New requests wait.
        ``wait_for_inflight_requests=True`` is vLLM's older spelling of ``mode="wait"``;
        ``clear_cache`` then drops the cached prefix blocks, as vLLM's does (the blocks of kept
        requests stay theirs)."""
        if wait_for_inflight_requests:
            mode = "wait"
        await self._engine_loop.settled(
            mode, lambda: self._requests.deliver(self.engine.pause(mode))
        )
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        await self._engine_loop.call(self.engine.resume)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's: drops the cached KV blocks between two steps (``LLMEngine``'s, with vLLM's
        arguments). Never needed: the engine drops them itself whenever a weight is written
        or KV memory is discarded."""
        reset = self.engine.reset_prefix_cache
        return bool(
            await self._engine_loop.call(lambda: reset(reset_running_requests, reset_connector))
        )

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """vLLM's: returns once no request is running or waiting (new requests are not held
        back meanwhile); raises ``TimeoutError`` after ``drain_timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout

        def is_busy() -> bool:
            return self.engine.has_unfinished_requests() or self._engine_loop.num_held > 0

        while await self._engine_loop.call(is_busy):
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
            return await self._engine_loop.call(lambda: self._sleep_rpc(args, kwargs or {}))
        return await self._engine_loop.call(call)

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
        return await refit_between_steps(
            self._engine_loop, self._requests, self.engine, write, policy, weight_version
        )

    # ── on the loop ──────────────────────────────────────────────────────────────────────────

    async def asleep_tags(self) -> tuple[str, ...]:
        """Tags asleep (or in between) on any rank."""
        return await self._engine_loop.call(lambda: self.engine.sleep_control.asleep_tags)

    async def memory_status(self) -> list[Any]:
        return await self._engine_loop.call(self.llm.memory_status)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on the loop thread between two steps (for calls this class does not
        wrap); returns its result or raises its error."""
        return await self._engine_loop.call(fn)

    def shutdown(self) -> None:
        """Stops the loop (running requests get ``EngineDeadError``) and the engine, also
        after the loop failed by itself; once."""
        if not self._is_shut_down:
            self._is_shut_down = True
            self._engine_loop.stop()
            self._tokenize_pool.shutdown(wait=False)
            self.llm.shutdown()

    def _sleep_rpc(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        self._requests.deliver(self.engine.sleep(*args, **kwargs))
        return list(self.engine.sleep_control.ranks)  # what collective_rpc("sleep") returns
