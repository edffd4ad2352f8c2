"""The cuda backend's copy batches, by either path (copy_path.py).

Both paths share the grouping below and differ only in how one copy is issued on a stream:

    path          issue                                         streams and events
    COPY_ENGINE   one ``cuMemcpyAsync`` (unified addressing      the backend's copy streams
                  picks the direction)
    SM            ``sm_copy`` on an ``ExternalStream`` over the  streams (and events) of its own,
                  raw stream; host addresses translated to      so that a HYBRID wake's halves
                  their device mapping (host_mappings.py)        run concurrently

An event recorded with ``cuEventRecord`` on the raw stream follows the kernels torch launched on
its ``ExternalStream`` (the same stream), so waiting works the same way for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dormant.memory.backend import Copy
from dormant.memory.cuda_driver import call, driver
from dormant.memory.errors import DriverError
from dormant.memory.host_mappings import HostMappings
from dormant.memory.sm_copy import sm_copy

Issue = Callable[[Copy, Any], None]  # starts one copy on a raw CUstream


def copy_engine_issue(copy: Copy, stream: Any) -> None:
    call("cuMemcpyAsync", copy.dst, copy.src, copy.nbytes, stream)


class SmIssue:
    """Starts a copy as elementwise kernels on the given raw stream of ``device``."""

    def __init__(self, device: torch.device, mappings: HostMappings) -> None:
        self._device, self._mappings = device, mappings
        self._torch_streams: dict[int, torch.cuda.ExternalStream] = {}

    def __call__(self, copy: Copy, stream: Any) -> None:
        handle = int(stream)
        torch_stream = self._torch_streams.get(handle)
        if torch_stream is None:
            torch_stream = torch.cuda.ExternalStream(handle, device=self._device)
            self._torch_streams[handle] = torch_stream
        dst = self._mappings.device_address(copy.dst)
        src = self._mappings.device_address(copy.src)
        try:
            with torch.cuda.stream(torch_stream):
                sm_copy(dst, src, copy.nbytes, self._device)
        except RuntimeError as error:  # torch's launch error: typed like a failed driver call
            raise DriverError(f"sm_copy of {copy.nbytes:,} bytes failed: {error}") from error


class EventPool:
    """Reusable CUDA events (timing disabled). Events are handed out in order from index 0 for
    each batch; a batch is always waited for completely before the next one with the same pool
    starts (each path has its own pool)."""

    def __init__(self) -> None:
        self._events: list[Any] = []

    def get(self, index: int) -> Any:
        while len(self._events) <= index:
            flags = driver().CUevent_flags.CU_EVENT_DISABLE_TIMING
            self._events.append(call("cuEventCreate", flags))
        return self._events[index]


class CudaCopies:
    """One issued copy per ``add`` (``copy_engine_issue`` unless told otherwise).

    Copies go in groups of at least ``GROUP_BYTES`` on one stream, each group closed by an event,
    and groups go round-robin over the streams. Large copies are a group each; thousands of small
    ones share an event per group, which keeps the driver calls per copy down to one.
    """

    GROUP_BYTES = 64 << 20

    def __init__(
        self, streams: list[Any], events: EventPool, issue: Issue = copy_engine_issue
    ) -> None:
        self._streams = streams
        self._events = events
        self._issue = issue
        self._group_of: list[int] = []  # copy index -> group index
        self._num_closed = 0
        self._open_bytes = 0
        self._is_synced: list[bool] = []

    def _stream(self) -> Any:
        return self._streams[self._num_closed % len(self._streams)]

    def add(self, copy: Copy) -> int:
        self._issue(copy, self._stream())
        self._group_of.append(self._num_closed)
        self._open_bytes += copy.nbytes
        if self._open_bytes >= self.GROUP_BYTES:
            self._close_group()
        return len(self._group_of) - 1

    def _close_group(self) -> None:
        call("cuEventRecord", self._events.get(self._num_closed), self._stream())
        self._is_synced.append(False)
        self._num_closed += 1
        self._open_bytes = 0

    def wait(self, index: int) -> None:
        group = self._group_of[index]
        if group == self._num_closed:  # the copy's group is still open
            self._close_group()
        if not self._is_synced[group]:
            call("cuEventSynchronize", self._events.get(group))
            self._is_synced[group] = True

    def wait_all(self) -> None:
        """Synchronizes the streams this batch used: none for a batch with no copy, so a sleep
        or wake that only releases or maps makes no call here."""
        has_open_group = bool(self._group_of) and self._group_of[-1] == self._num_closed
        num_groups = self._num_closed + has_open_group
        for stream in self._streams[: min(num_groups, len(self._streams))]:
            call("cuStreamSynchronize", stream)
