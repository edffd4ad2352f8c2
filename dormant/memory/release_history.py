"""When the memory layer last gave physical memory back to the driver, and how much.

The driver reclaims released memory for a while after ``cuMemRelease`` returns, and on the H200
it does so with the copy engines: for ~0.25 s after a 60 GiB release, pinned host-to-device
copies run at 28 GB/s instead of 55 (benchmarks/results/2026-12-02d-run3-release-contention.jsonl).
A wake reads this history to choose how it copies (copy_path.py).

Every release the manager makes is recorded: a sleep's (steps.ReleaseClock) and a freed
allocation's (blocks.BlockTable.free). Thread-safe: a sleep's discard thread and a storage's
deleter (any thread) record too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

KEEP_S = 10.0  # records older than this are dropped: no policy looks further back


class ReleaseHistory:
    """Releases as (time, bytes), stamped by ``clock`` (seconds, monotonic) when each release
    returned. ``clock`` is a public attribute so tests can inject one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._records: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def record(self, nbytes: int) -> None:
        """Notes that ``nbytes`` were released just now."""
        now = self.clock()
        with self._lock:
            self._records.append((now, nbytes))
            while self._records and self._records[0][0] < now - KEEP_S:
                self._records.popleft()

    def recent_bytes(self, window_s: float) -> int:
        """The bytes released in the last ``window_s`` seconds (a release at exactly
        ``now - window_s`` counts)."""
        since = self.clock() - window_s
        with self._lock:
            return sum(nbytes for at, nbytes in self._records if at >= since)

    def seconds_since_last(self) -> float | None:
        """Seconds since the last recorded release; None if there was none (or too long ago)."""
        with self._lock:
            last = self._records[-1][0] if self._records else None
        return None if last is None else self.clock() - last
