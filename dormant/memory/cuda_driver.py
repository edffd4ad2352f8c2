"""Checked calls into NVIDIA's driver bindings (``cuda.bindings.driver``), imported lazily.

Every failed call raises ``DriverError`` naming the call and the CUDA error string; running out of
device memory raises ``OutOfMemoryError`` instead, so callers can roll back.
"""

from __future__ import annotations

import threading
from typing import Any

from dormant.memory.errors import DriverError, OutOfMemoryError

_driver: Any = None
_import_lock = threading.Lock()


def driver() -> Any:
    """The ``cuda.bindings.driver`` module (imported on first use)."""
    global _driver
    if _driver is None:
        with _import_lock:
            if _driver is None:
                try:
                    from cuda.bindings import driver as module
                except ImportError as error:
                    raise DriverError(
                        "the cuda backend needs NVIDIA's cuda-bindings: pip install cuda-bindings"
                    ) from error
                _driver = module
    return _driver


def error_text(result: Any) -> str:
    cu = driver()
    _, name = cu.cuGetErrorName(result)
    _, text = cu.cuGetErrorString(result)
    decode = lambda s: s.decode() if isinstance(s, bytes) else str(s)  # noqa: E731
    return f"{decode(name)}: {decode(text)}"


def call(name: str, *args: Any, nbytes: int = 0) -> Any:
    """Calls ``cuda.bindings.driver.<name>(*args)``; returns its value(s) or raises."""
    cu = driver()
    result = getattr(cu, name)(*args)
    status, values = result[0], result[1:]
    if status != cu.CUresult.CUDA_SUCCESS:
        if status == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            free = _free_bytes()
            raise OutOfMemoryError(
                f"{name} could not get {nbytes:,} bytes of device memory ({free:,} free)",
                bytes_requested=nbytes,
                bytes_free=free,
            )
        raise DriverError(f"{name} failed: {error_text(status)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _free_bytes() -> int:
    cu = driver()
    status, free, _ = cu.cuMemGetInfo()
    return int(free) if status == cu.CUresult.CUDA_SUCCESS else -1
