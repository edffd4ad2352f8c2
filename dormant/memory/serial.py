"""A lock for the manager's operations, and work deferred until nobody holds it.

Tensor storages die whenever the garbage collector says so: on any thread, and even in the middle
of one of the manager's own operations (a temporary dropped inside ``sleep``). Their frees cannot
take the lock there (it is not reentrant, and must not be), so they are queued and run by whoever
leaves the lock next, or at once when nobody holds it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class SerialSection:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deferred: deque[Callable[[], None]] = deque()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Holds the lock; deferred work queued meanwhile runs before and after it is released."""
        with self._lock:
            try:
                yield
            finally:
                self._run_deferred()
        self._drain()

    def defer(self, work: Callable[[], None]) -> None:
        """Runs ``work`` under the lock: now if it is free, else when its holder leaves."""
        self._deferred.append(work)
        self._drain()

    def _drain(self) -> None:
        # A failed acquire means a holder exists, and it runs the queue before it releases.
        while self._deferred and self._lock.acquire(blocking=False):
            try:
                self._run_deferred()
            finally:
                self._lock.release()

    def _run_deferred(self) -> None:
        while self._deferred:
            self._deferred.popleft()()
