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
``states`` but stays tracked while the engine runs it. Each tracked request's ``newest`` is
the output last built for it, set before its listener is called with it. ``_pending`` holds
caller ids whose add is queued and has not run (it may be held behind the loop's closed gate);
``_cancelled`` holds those of them that were aborted before it ran.
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


class RequestTracker:
    """The requests an ``AsyncLLM`` is generating, and who listens to each."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._tracked: dict[str, TrackedRequest] = {}  # str(engine request id) → who listens
        self._user_ids: dict[str, str] = {}
        self._cancelled: set[str] = set()  # pending ids aborted before their add ran
        self._pending: set[str] = set()
        self._lock = threading.Lock()  # see the module docstring for what it guards

    @property
    def num_tracked(self) -> int:
        """Requests added and not yet finished (readable off the loop: an instant's count)."""
        return len(self._tracked)

    def expect(self, user_id: str) -> None:
        """Records that ``user_id``'s add is about to be queued (any thread)."""
        with self._lock:
            self._pending.add(user_id)

    def forget(self, user_id: str) -> None:
        """Drops ``user_id``'s pending add, which will never run (any thread)."""
        with self._lock:
            self._pending.discard(user_id)

    def add(self, request: Any, tracked: TrackedRequest) -> Any:
        """Adds ``request`` (a ``RequestInput``, or ``(prompt, params)`` for engines without
        ``make_request_input``) and returns the engine's id for it. Raises, adding nothing,
        if the caller's id is in flight, or if the engine cannot generate (asleep or stale
        weights; a pause alone lets the request wait). Aborted while it was held, it is added
        and aborted at once: its stream ends with an aborted output, as a running one's does."""
        self.forget(tracked.user_id)
        is_aborted = tracked.user_id in self._cancelled
        self._cancelled.discard(tracked.user_id)
        if tracked.user_id in self._user_ids:
            raise DuplicateRequestIdError(
                f"Request id {tracked.user_id!r} already running (its engine request has not "
                "finished, or was not aborted yet); give each running request its own id"
            )
        control = self.engine.sleep_control
        if not is_aborted and not (control.is_paused and control.is_fully_awake):
            self.engine.check_can_generate()  # a pause only: the request waits
        if isinstance(request, tuple):
            tracked.engine_id = self.engine.add_request(*request)
        else:
            tracked.engine_id = self.engine.add_request_input(request)
        tracked.newest = self.engine.request_output(tracked.engine_id)
        with self._lock:
            self._tracked[str(tracked.engine_id)] = tracked
            self._user_ids[tracked.user_id] = str(tracked.engine_id)
        if is_aborted:  # never scheduled: the abort lands before the next step
            self.abort_engine_ids([tracked.engine_id])
        return tracked.engine_id

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
        if tracked.engine_id is None:
            with self._lock:
                if tracked.user_id in self._pending:
                    self._cancelled.add(tracked.user_id)
        elif self._tracked.get(str(tracked.engine_id)) is tracked:
            self.abort_engine_ids([tracked.engine_id])

    def abort_users(self, user_ids: Sequence[str]) -> None:
        """Aborts by the callers' ids; one whose add has not run yet (held behind the gate) is
        aborted when it runs. An id that finished or was never added changes nothing."""
        keys = [self._user_ids[i] for i in user_ids if i in self._user_ids]
        self.abort_engine_ids([self._tracked[k].engine_id for k in keys])
        with self._lock:
            self._cancelled.update(i for i in user_ids if i in self._pending)

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
