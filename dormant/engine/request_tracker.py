"""``RequestTracker``: which caller listens to which engine request.

``AsyncLLM.generate`` callers name requests by their own ids; the engine names them by the id
its ``add_request`` returns. The tracker maps one to the other and hands each listener its
request's outputs, progress and errors. Only the loop thread calls it (the engine is not
thread-safe), except ``expect`` and ``forget``, which callers use around queueing their add,
and ``states`` and ``answer``, through which vLLM's ``output_processor`` reaches the running
requests from the caller's thread (``vllm_internals.py``). Those take the tracker's lock, and
so does the loop thread wherever it changes what they read.

Invariants: ``_tracked`` and ``_user_ids`` hold the same requests (keyed by engine id and by
caller id); a request leaves both when its finished output is delivered or it fails. A request
is *answered* once a caller handed its stream the last output (``answer``): it leaves
``states`` and the unfinished count but stays tracked while the engine runs it. Each tracked
request's ``newest`` is the output last built for it, set before its listener is called with
it. ``_pending`` maps a caller id to the one request of that id whose add is queued and has not
run (it may be held behind the loop's closed gate). A pending request aborted before its add
runs leaves ``_pending`` at once, marked ``is_cancelled``: its id is free for a new request,
and its add, when it runs, adds and aborts it.

A caller id names at most one request in flight, pending or running: vLLM <= 0.12 refuses a
second ``generate`` with a running id ("Request id ... already running."), and a request whose
add is pending is one vLLM has already registered. ``expect`` refuses an id that is pending,
``add`` one that is running.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dormant.core.errors import DuplicateRequestIdError
from dormant.engine.llm_engine import LLMEngine
from dormant.engine.outputs import RequestOutput

# Called on the loop thread; it must not raise (the loop serves every other caller too).
Listener = Callable[[RequestOutput | BaseException], None]


@dataclasses.dataclass
class TrackedRequest:
    user_id: str
    listener: Listener
    wants_progress: bool
    engine_id: Any = None  # what the engine's add_request returned
    num_tokens_sent: int = 0
    num_generated_seen: int = 0  # the engine's count when its output was last built
    newest: RequestOutput | None = None  # the output last built for it (from its add on)
    is_answered: bool = False  # a caller handed its stream the last output (``answer``)
    is_cancelled: bool = False  # aborted while pending: its add adds and aborts it


class RequestTracker:
    """The requests an ``AsyncLLM`` is generating, and who listens to each."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._tracked: dict[str, TrackedRequest] = {}  # str(engine request id) → who listens
        self._user_ids: dict[str, str] = {}
        self._pending: dict[str, TrackedRequest] = {}  # caller id → its request not added yet
        self._lock = threading.Lock()  # see the module docstring for what it guards

    @property
    def num_tracked(self) -> int:
        """Requests added and not yet finished (readable off the loop: an instant's count)."""
        return len(self._tracked)

    @property
    def num_unfinished(self) -> int:
        """vLLM's ``OutputProcessor.get_num_unfinished_requests()``: the requests whose stream
        is still owed its last output, added (not answered) or pending (any thread)."""
        with self._lock:
            answered = sum(tracked.is_answered for tracked in self._tracked.values())
            return len(self._tracked) - answered + len(self._pending)

    def expect(self, tracked: TrackedRequest) -> None:
        """Records that ``tracked``'s add is about to be queued (any thread). Raises
        ``DuplicateRequestIdError``, recording nothing, if a request of the same caller id is
        pending already (one that is running is refused by ``add``)."""
        with self._lock:
            if tracked.user_id in self._pending:
                raise DuplicateRequestIdError(
                    f"Request id {tracked.user_id!r} already running (an earlier generate() "
                    "with this id is waiting to be added); give each running request its own "
                    "id, or abort the earlier one first"
                )
            self._pending[tracked.user_id] = tracked

    def forget(self, tracked: TrackedRequest) -> None:
        """Drops ``tracked``'s pending add, which will never run (any thread)."""
        with self._lock:
            self._drop_pending(tracked)

    def cancel_pending(self, tracked: TrackedRequest) -> bool:
        """Aborts ``tracked`` if its add has not run (any thread): its id is free at once, and
        its add, when it runs, adds and aborts it. Returns whether it was pending."""
        with self._lock:
            if self._pending.get(tracked.user_id) is not tracked:
                return False
            self._drop_pending(tracked)
            tracked.is_cancelled = True
            return True

    def add(self, request: Any, tracked: TrackedRequest) -> Any:
        """Adds ``request`` (a ``RequestInput``, or ``(prompt, params)`` for engines without
        ``make_request_input``) and returns the engine's id for it. Raises, adding nothing,
        if the caller's id is running, or if the engine cannot generate (asleep or stale
        weights; a pause alone lets the request wait). Aborted while it was pending, it is
        added and aborted at once: its stream ends with an aborted output, as a running one's
        does. It stays pending until it is tracked, so the unfinished count never dips."""
        try:
            engine_id = self._add_to_engine(request, tracked)
        except BaseException:
            self.forget(tracked)
            raise
        with self._lock:
            self._drop_pending(tracked)
            self._tracked[str(engine_id)] = tracked
            self._user_ids[tracked.user_id] = str(engine_id)
            is_cancelled = tracked.is_cancelled
        if is_cancelled:  # never scheduled: the abort lands before the next step
            self.abort_engine_ids([engine_id])
        return engine_id

    def _add_to_engine(self, request: Any, tracked: TrackedRequest) -> Any:
        if tracked.user_id in self._user_ids:
            raise DuplicateRequestIdError(
                f"Request id {tracked.user_id!r} already running (its engine request has not "
                "finished, or was not aborted yet); give each running request its own id"
            )
        control = self.engine.sleep_control
        if not tracked.is_cancelled and not (control.is_paused and control.is_fully_awake):
            self.engine.check_can_generate()  # a pause only: the request waits
        if isinstance(request, tuple):
            tracked.engine_id = self.engine.add_request(*request)
        else:
            tracked.engine_id = self.engine.add_request_input(request)
        tracked.newest = self.engine.request_output(tracked.engine_id)
        return tracked.engine_id

    def _drop_pending(self, tracked: TrackedRequest) -> None:
        """Under the lock: ``tracked`` leaves ``_pending`` (another request of its id stays)."""
        if self._pending.get(tracked.user_id) is tracked:
            del self._pending[tracked.user_id]

    def deliver(self, outputs: Sequence[RequestOutput]) -> None:
        """Hands finished outputs to their listeners and forgets those requests."""
        done = []
        with self._lock:
            for output in outputs:
                tracked = self._tracked.pop(str(output.request_id), None)
                if tracked is not None:
                    self._user_ids.pop(tracked.user_id, None)
                    done.append((tracked, output))
        for tracked, output in done:
            tracked.listener(output)

    def send_progress(self) -> None:
        """Hands each listener that wants progress its request's output, if it grew. Only the
        requests that generated tokens since the last look have their output built: a step
        costs the requests it advanced, not every request waiting for a slot."""
        outputs = self.engine.outputs
        for tracked in self._tracked.values():
            if not tracked.wants_progress or tracked.is_answered:
                continue
            num_generated = outputs.num_generated(tracked.engine_id)
            if num_generated is None or num_generated == tracked.num_generated_seen:
                continue
            tracked.num_generated_seen = num_generated
            output = self.engine.request_output(tracked.engine_id)
            if output is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            if num_tokens > tracked.num_tokens_sent:
                tracked.num_tokens_sent = num_tokens
                tracked.newest = output  # before the stream can see it (vllm_internals.py)
                tracked.listener(output)

    def abort_engine_ids(self, engine_ids: Iterable[Any] | None) -> None:
        """Aborts (all when None) and answers them; an empty list aborts nothing."""
        ids = None if engine_ids is None else list(engine_ids)
        if ids is None or ids:
            self.deliver(self.engine.abort_request(ids))

    def abort_tracked(self, tracked: TrackedRequest) -> None:
        """Aborts ``tracked``'s request (its caller stopped listening), never another request
        that has the same caller id; one whose add has not run yet is aborted when it runs."""
        if self.cancel_pending(tracked):
            return
        if tracked.engine_id is not None and self._tracked.get(str(tracked.engine_id)) is tracked:
            self.abort_engine_ids([tracked.engine_id])

    def abort_users(self, user_ids: Sequence[str]) -> None:
        """Aborts by the callers' ids; one whose add has not run yet (held behind the gate) is
        aborted when it runs. An id that finished or was never added changes nothing."""
        keys = [self._user_ids[i] for i in user_ids if i in self._user_ids]
        self.abort_engine_ids([self._tracked[k].engine_id for k in keys])
        with self._lock:
            pending = [self._pending[i] for i in user_ids if i in self._pending]
        for tracked in pending:
            self.cancel_pending(tracked)

    def ids_with_tokens(self) -> list[Any]:
        """Requests that already generated tokens (the ones a refit would mix)."""
        ids = []
        for tracked in self._tracked.values():
            output = self.engine.request_output(tracked.engine_id)
            if output is not None and any(c.token_ids for c in output.outputs):
                ids.append(tracked.engine_id)
        return ids

    def fail_all(self, error: BaseException) -> None:
        """Hands ``error`` to every listener and forgets every request."""
        with self._lock:
            failed = list(self._tracked.values())
            self._tracked.clear()
            self._user_ids.clear()
        for tracked in failed:
            tracked.listener(error)

    # ── for vLLM's output_processor, from any thread ─────────────────────────────────────────

    def states(self) -> list[TrackedRequest]:
        """The tracked requests not yet answered, in the order they were added."""
        with self._lock:
            return [tracked for tracked in self._tracked.values() if not tracked.is_answered]

    def answer(self, user_id: str) -> TrackedRequest | None:
        """Marks ``user_id``'s request answered and returns it; the caller hands its stream the
        last output. It gets no more progress, and the engine runs it until it finishes or is
        aborted. None if it is not tracked or was answered already."""
        with self._lock:
            key = self._user_ids.get(user_id)
            tracked = None if key is None else self._tracked.get(key)
            if tracked is None or tracked.is_answered:
                return None
            tracked.is_answered = True
            return tracked
