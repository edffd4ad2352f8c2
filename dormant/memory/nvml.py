"""The driver's own accounting of device memory, read through NVML (``libnvidia-ml.so.1``, which
ships with the driver) by ctypes: per device, and per process.

NVML is not the CUDA driver API: reading it never creates a CUDA context, and another process
can read it about a process whose CUDA state is locked or checkpointed (``process_checkpoint.py``).
The locked process itself cannot: its own NVML calls block until it is unlocked, as its CUDA calls
do (seen on an H200, driver 580), so while released it reads through the checkpoint helper
(``read`` is what the helper calls). This module imports only the standard library, so the
helper loads it by path. Every reading is optional: without NVML, or for a process NVML does not
list (a PID namespace hides the host's process ids from a container), the functions return None
and callers say the figure is unknown. Never an estimate.
"""

from __future__ import annotations

import ctypes
import threading
from typing import NamedTuple

_NVML_SUCCESS = 0
_NVML_ERROR_INSUFFICIENT_SIZE = 7
_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE for unsigned long long


class _ProcessInfo(ctypes.Structure):
    """``nvmlProcessInfo_t`` (the layout of the v2 and v3 queries)."""

    _fields_ = (
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    )


class _Memory(ctypes.Structure):
    """``nvmlMemory_t``."""

    _fields_ = (
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    )


class DeviceMemory(NamedTuple):
    used_bytes: int
    total_bytes: int


class Reading(NamedTuple):
    """One process's figure and the device's, read together (None: unknown)."""

    process_bytes: int | None
    device: DeviceMemory | None


UNKNOWN = Reading(None, None)


_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # loaded (and nvmlInit'ed) once; [None] if unavailable


def _nvml() -> ctypes.CDLL | None:
    with _lock:
        if not _library:
            _library.append(_load())
        return _library[0]


def _load() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != _NVML_SUCCESS:
            return None
    except (OSError, AttributeError):
        return None
    return lib


def is_available() -> bool:
    return _nvml() is not None


def _device(lib: ctypes.CDLL, pci_bus_id: str) -> ctypes.c_void_p | None:
    handle = ctypes.c_void_p()
    getter = getattr(lib, "nvmlDeviceGetHandleByPciBusId_v2", None)
    if getter is None or getter(pci_bus_id.encode(), ctypes.byref(handle)) != _NVML_SUCCESS:
        return None
    return handle


def device_memory(pci_bus_id: str) -> DeviceMemory | None:
    """The device's memory in use (every process, and the driver's own) and its total."""
    lib = _nvml()
    handle = None if lib is None else _device(lib, pci_bus_id)
    if lib is None or handle is None:
        return None
    memory = _Memory()
    if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != _NVML_SUCCESS:
        return None
    return DeviceMemory(int(memory.used), int(memory.total))


def process_memory(pci_bus_id: str, pid: int) -> int | None:
    """Device memory the driver accounts to process ``pid`` on the device: 0 when the device
    runs no context of it (a checkpointed process has none), None when unknown."""
    usage = compute_processes(pci_bus_id)
    if usage is None:
        return None
    return usage.get(pid, 0)


def read(pci_bus_id: str, pid: int) -> Reading:
    """``process_memory`` and ``device_memory`` at once."""
    return Reading(process_memory(pci_bus_id, pid), device_memory(pci_bus_id))


def compute_processes(pci_bus_id: str) -> dict[int, int] | None:
    """pid → device memory, for every process with a context on the device (None: unknown;
    a process whose figure NVML withholds is left out). Under MPS the device runs the MPS
    server's context: its clients are ``mps_clients``."""
    listed = _processes(pci_bus_id, "nvmlDeviceGetComputeRunningProcesses")
    if listed is None:
        return None
    return {pid: used for pid, used in listed.items() if used is not None}


def mps_clients(pci_bus_id: str) -> dict[int, int | None] | None:
    """pid → device memory (None where NVML withholds it) of every process that runs on the
    device as a client of an MPS server; empty without one, None when unknown."""
    return _processes(pci_bus_id, "nvmlDeviceGetMPSComputeRunningProcesses")


def _processes(pci_bus_id: str, query_name: str) -> dict[int, int | None] | None:
    """NVML's ``<query_name>_v3`` (or ``_v2``) list: pid → memory, None where not available."""
    lib = _nvml()
    handle = None if lib is None else _device(lib, pci_bus_id)
    if lib is None or handle is None:
        return None
    query = getattr(lib, f"{query_name}_v3", None) or getattr(lib, f"{query_name}_v2", None)
    if query is None:
        return None
    count = ctypes.c_uint(0)
    for _ in range(4):  # the list can grow between the two calls
        infos = (_ProcessInfo * max(count.value, 1))()
        result = query(handle, ctypes.byref(count), infos)
        if result == _NVML_SUCCESS:
            return {
                int(i.pid): None if i.usedGpuMemory == _NOT_AVAILABLE else int(i.usedGpuMemory)
                for i in infos[: count.value]
            }
        if result != _NVML_ERROR_INSUFFICIENT_SIZE:
            return None
        count = ctypes.c_uint(count.value + 4)
    return None
