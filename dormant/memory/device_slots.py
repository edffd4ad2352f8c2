"""One live MemoryManager per device per process: the slots they claim."""

from __future__ import annotations

import threading

from dormant.memory.errors import ManagerExistsError

_live_devices: set[str] = set()
_lock = threading.Lock()


def claim(device_key: str) -> None:
    """Takes ``device_key``'s slot; raises ManagerExistsError if a live manager holds it."""
    with _lock:
        if device_key in _live_devices:
            raise ManagerExistsError(
                f"a MemoryManager for {device_key} already exists in this process; share it, or "
                "close() it before creating another"
            )
        _live_devices.add(device_key)


def give_back(device_key: str) -> None:
    with _lock:
        _live_devices.discard(device_key)
