"""Where registered (pinned) host memory appears in the device's address space.

A kernel reaches pinned host memory through a device pointer (``cuMemHostGetDevicePointer``).
On a device with ``CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`` (every Linux data-center GPU with
unified addressing) it equals the host pointer, but the driver does not promise it, so the cuda
backend records each registered range's device base when it pins it, and ``device_address``
translates by the offset into the range. An address in no registered range is device memory and
is returned as it is. Thread-safe: the arena pins its chunks from several threads.
"""

from __future__ import annotations

import bisect
import threading


class HostMappings:
    """Registered host ranges → their device base addresses."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # sorted host base addresses
        self._ranges: dict[int, tuple[int, int]] = {}  # host base -> (bytes, device base)
        self._lock = threading.Lock()

    def add(self, host: int, nbytes: int, device: int) -> None:
        with self._lock:
            if host in self._ranges:
                raise ValueError(f"host range {host:#x} is registered already")
            bisect.insort(self._starts, host)
            self._ranges[host] = (nbytes, device)

    def remove(self, host: int) -> None:
        with self._lock:
            if self._ranges.pop(host, None) is not None:
                self._starts.remove(host)

    def device_address(self, address: int) -> int:
        """The device address of ``address``: translated if it lies in a registered range."""
        with self._lock:
            index = bisect.bisect_right(self._starts, address) - 1
            if index < 0:
                return address
            start = self._starts[index]
            nbytes, device = self._ranges[start]
        return device + (address - start) if address < start + nbytes else address
