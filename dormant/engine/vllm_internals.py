"""The parts of vLLM's ``AsyncLLM`` that RL frameworks reach into, over dormant's request tracker.

verl aborts requests through vLLM's internals, not through ``AsyncLLM.abort``
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``, ``abort_all_requests`` and
``abort_request``)::

    states = list(engine.output_processor.request_states.items())      # a snapshot
    for _, state in states:
        output = state.make_request_output([], pooling_output=None,
                                           finish_reason=FinishReason.ABORT, stop_reason=None)
        state.queue.put(output)                     # its generate() stream ends with it
    engine.output_processor.abort_requests(ids)     # the states go
    await engine.engine_core.abort_requests_async(ids)   # the engine stops them

Each piece does what vLLM's does (``vllm/v1/engine/output_processor.py``, ``core_client.py``),
with two differences that follow from dormant's loop thread. ``request_states`` is a read-only
snapshot taken under the tracker's lock, since the loop finishes requests while a caller on
another thread reads it. And ``make_request_output`` builds from the output the loop last built
for the request (set before its stream could see it), not from the engine, which only the loop
may touch. A FINAL_ONLY request has no such output until it finishes (the loop builds none per
step, as vLLM's ``RequestState.make_request_output`` returns None for it), yet vLLM's aborted
one carries the tokens, text and logprobs so far, which its output processor keeps per step
(``_new_completion_output``): dormant's engine keeps them per step too, and the loop builds the
outputs of a snapshot's FINAL_ONLY requests in one round trip, the first time one is asked for
with a finish reason. That call blocks its thread for at most the step in progress; the
decode loop pays nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from dormant.core.errors import EngineDeadError, UnsupportedOptionError
from dormant.engine.engine_loop import EngineLoop
from dormant.engine.outputs import RequestOutput
from dormant.engine.request_tracker import Listener, RequestTracker, TrackedRequest

# vllm/v1/engine/__init__.py: the finish_reason strings outputs carry, by FinishReason value.
FINISH_REASON_STRINGS = ("stop", "length", "abort", "error", "repetition")


class FinishReason(enum.IntEnum):
    """vLLM's ``vllm.v1.engine.FinishReason`` (``install_as_vllm`` registers it): an int whose
    ``str()`` is the ``finish_reason`` string of outputs. dormant's own requests finish with
    STOP, LENGTH or ABORT (``sequence.FinishReason`` holds those strings)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return FINISH_REASON_STRINGS[self.value]


class OutputQueue:
    """vLLM's ``RequestOutputCollector`` as callers feed it: ``put`` hands an output (or an
    error, which its stream raises) to the request's ``generate`` stream, from any thread. A
    finished output ends the stream; a later one is dropped."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener

    def put(self, output: RequestOutput | Exception) -> None:
        if not isinstance(output, RequestOutput | Exception):
            raise TypeError(
                f"queue.put takes a RequestOutput (from make_request_output) or an exception, "
                f"got {type(output).__name__}"
            )
        self._listener(output)


class FinalOnlyOutputs:
    """The engine's outputs so far of one snapshot's FINAL_ONLY requests, built by the loop in
    one blocking round trip the first time one is needed (verl builds an abort output for every
    state of its snapshot, one after another)."""

    def __init__(self, engine_loop: EngineLoop, tracked: Iterable[TrackedRequest]) -> None:
        self._engine_loop = engine_loop
        self._final_only = [t for t in tracked if not t.wants_progress]
        self._outputs: dict[str, RequestOutput | None] | None = None

    def output(self, tracked: TrackedRequest) -> RequestOutput | None:
        """``tracked``'s output as the engine held it at the round trip; None if the request
        finished before it, or the loop had stopped."""
        if self._outputs is None:
            engine, final_only = self._engine_loop.engine, self._final_only
            try:
                self._outputs = self._engine_loop.call_blocking(
                    lambda: {t.user_id: engine.request_output(t.engine_id) for t in final_only}
                )
            except EngineDeadError:  # the requests were failed: nothing left to build from
                self._outputs = {}
        return self._outputs.get(tracked.user_id)


class RequestState:
    """vLLM's ``RequestState`` of one running request: ``request_id`` (the id given to
    ``generate``), ``queue`` and ``make_request_output``."""

    def __init__(self, tracked: TrackedRequest, final_only: FinalOnlyOutputs) -> None:
        self._tracked = tracked
        self._final_only = final_only
        self.request_id = tracked.user_id
        self.queue = OutputQueue(tracked.listener)

    def make_request_output(
        self,
        new_token_ids: Sequence[int],
        pooling_output: Any,
        finish_reason: Any,
        stop_reason: int | str | None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> RequestOutput | None:
        """The request's output as the loop last built it, its unfinished completions finished
        with ``finish_reason`` (a ``FinishReason``, or its string) and ``stop_reason``. With
        ``finish_reason=None``: that output unfinished, or None for a FINAL_ONLY request (as
        vLLM's). A FINAL_ONLY request's finished output holds what the engine generated so far
        (``FinalOnlyOutputs``: this may wait for the step in progress). Changes nothing;
        ``queue.put`` delivers it.

        ``new_token_ids`` must be empty (dormant's outputs hold the engine's tokens), and
        ``pooling_output`` and ``kv_transfer_params`` None (no pooling models, no KV transfer):
        anything else raises ``UnsupportedOptionError``."""
        reason = _finish_reason(finish_reason, new_token_ids, pooling_output, kv_transfer_params)
        newest = self._tracked.newest
        assert newest is not None  # set before the request was tracked
        is_final_only = not self._tracked.wants_progress
        if reason is None:
            if is_final_only:
                return None
            return dataclasses.replace(newest, request_id=self.request_id)
        if is_final_only:
            newest = self._final_only.output(self._tracked) or newest
        completions = [
            completion
            if completion.finish_reason is not None
            else dataclasses.replace(completion, finish_reason=reason, stop_reason=stop_reason)
            for completion in newest.outputs
        ]
        return dataclasses.replace(
            newest, request_id=self.request_id, outputs=completions, finished=True
        )


def _finish_reason(
    finish_reason: Any,
    new_token_ids: Sequence[int],
    pooling_output: Any,
    kv_transfer_params: dict[str, Any] | None,
) -> str | None:
    """``finish_reason`` as its string (None stays None); raises on what dormant cannot build."""
    if len(new_token_ids) != 0:
        raise UnsupportedOptionError(
            f"new_token_ids={list(new_token_ids)!r}: dormant builds outputs from the tokens "
            "its engine generated; pass []"
        )
    if pooling_output is not None or kv_transfer_params is not None:
        raise UnsupportedOptionError(
            "pooling_output / kv_transfer_params: dormant serves no pooling models and "
            "transfers no KV; pass None"
        )
    if finish_reason is None:
        return None
    reason = str(finish_reason)
    if reason not in FINISH_REASON_STRINGS:
        raise UnsupportedOptionError(
            f"finish_reason={finish_reason!r}: pass a vllm.v1.engine.FinishReason (such as "
            f"FinishReason.ABORT) or one of {FINISH_REASON_STRINGS}"
        )
    return reason


class OutputProcessorView:
    """vLLM's ``AsyncLLM.output_processor``: ``request_states``, the unfinished-request counts
    (OpenRLHF balances prompts over its engines by them) and ``abort_requests``."""

    def __init__(self, requests: RequestTracker, engine_loop: EngineLoop) -> None:
        self._requests = requests
        self._engine_loop = engine_loop

    @property
    def request_states(self) -> Mapping[str, RequestState]:
        """The running requests by the id given to ``generate``, except those already handed
        their last output: a read-only snapshot, safe to take from any thread while the loop
        finishes requests. A request held behind a closed gate (a ``wait`` pause, sleep or
        refit draining) is listed once its add runs; ``AsyncLLM.abort`` reaches it before."""
        tracked = self._requests.states()
        final_only = FinalOnlyOutputs(self._engine_loop, tracked)
        return MappingProxyType({t.user_id: RequestState(t, final_only) for t in tracked})

    def get_num_unfinished_requests(self) -> int:
        """vLLM's ``len(request_states)``: the requests whose streams are still owed their
        last output, from ``generate`` until they finished or ``abort_requests`` removed them
        (the engine may still run them). One whose add waits, even behind a closed gate,
        counts, as vLLM's does from ``generate`` on, though ``request_states`` lists it only
        once its add runs (``RequestTracker.num_unfinished``)."""
        return self._requests.num_unfinished

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def abort_requests(self, request_ids: Iterable[str], internal: bool = False) -> list[str]:
        """vLLM's: each request still in ``request_states`` leaves it, and its stream is handed
        an output finished with "abort" (a stream that already got its last output keeps it).
        The engine still runs them until ``engine_core.abort_requests_async``. Returns the ids
        it removed; unknown or finished ids are ignored. ``internal`` is vLLM's: dormant's
        request ids are the callers' either way."""
        if isinstance(request_ids, str):
            raise TypeError(f"abort_requests takes a list of request ids, got {request_ids!r}")
        answered = [self._requests.answer(request_id) for request_id in request_ids]
        removed = [tracked for tracked in answered if tracked is not None]
        final_only = FinalOnlyOutputs(self._engine_loop, removed)
        for tracked in removed:
            state = RequestState(tracked, final_only)
            output = state.make_request_output([], None, FinishReason.ABORT, None)
            assert output is not None  # a finished output is always built
            state.queue.put(output)
        return [tracked.user_id for tracked in removed]


class EngineCoreView:
    """vLLM's ``AsyncLLM.engine_core`` (its ``EngineCoreClient``), for aborting requests."""

    def __init__(self, engine_loop: EngineLoop, requests: RequestTracker) -> None:
        self._engine_loop = engine_loop
        self._requests = requests

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        """Aborts these requests (by the ids given to ``generate``) in the engine between two
        steps: they stop and their blocks are freed; a stream not handed its last output yet
        ends with an aborted one, and a request whose add is held is aborted when it runs.
        Unknown or finished ids are ignored; once the engine stopped this does nothing, as
        vLLM's does once its engine core is dead."""
        if isinstance(request_ids, str):
            raise TypeError(
                f"abort_requests_async takes a list of request ids, got {request_ids!r}"
            )
        ids = list(request_ids)
        if ids and not self._engine_loop.is_stopped:
            await self._engine_loop.call(lambda: self._requests.abort_users(ids))
