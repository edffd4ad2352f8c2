"""The helper process of ``process_checkpoint.py``: it calls the CUDA driver's process-checkpoint
API (``cuCheckpointProcess*``, driver 570+, CUDA 12.8+) on another process, the engine's.

The API acts on a process by its PID and is meant for a controller outside it (NVIDIA's
``cuda-checkpoint`` utility is one): locking a process blocks every CUDA call in it, so the engine
cannot drive its own checkpoint. This helper does, one request at a time.

It is run as a script (``python -I -S checkpoint_helper.py``), never imported: standard library
only, so it starts in milliseconds and loads nothing of torch. It calls ``cuInit`` (the driver's
restore needs it in the calling process) but never creates a CUDA context, so it holds no device
memory and NVML does not list it.

Protocol: one JSON object per line on stdin, one reply per line on stdout.

| request                                   | reply when it worked                            |
|-------------------------------------------|-------------------------------------------------|
| ``{"op": "probe", "pid": p}``             | ``{"ok": true, "driver_version": v, "state": s}``|
| ``{"op": "lock", "pid": p, "timeout_ms": t}`` | ``{"ok": true, "seconds": ..., "state": s}``|
| ``{"op": "checkpoint" / "restore" / "unlock", "pid": p}`` | the same                        |
| ``{"op": "state", "pid": p}``             | ``{"ok": true, "state": s}``                    |
| ``{"op": "memory", "pid": p, "pci_bus_id": b}`` | ``{"ok": true, "process_bytes": n,``      |
|                                           | ``"device_used_bytes": u, "device_total_bytes": t}`` |

``memory`` is NVML's accounting (``dormant/memory/nvml.py``, loaded by path: it imports only the
standard library), null where unknown: a process whose CUDA state is locked blocks in its own
NVML calls, so it asks here.

A failure replies ``{"ok": false, "reason": r, "call": name, "code": c, "error": text, "state":
s}``: ``reason`` is ``"library"`` (no libcuda), ``"init"`` (cuInit failed), ``"symbols"`` (the
driver lacks the API), ``"version"`` (too old) or ``"call"`` (a checkpoint call failed); ``state``
is the target's ``CUprocessState`` after the failure (None when it cannot be read).
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path
from typing import Any

MIN_DRIVER_VERSION = 12080  # CUDA 12.8, display driver 570: the driver API at utility parity
CALLS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)
# The args structs (CUcheckpoint*Args) are zeroed buffers larger than any version's struct, so a
# driver that knows more fields reads zeros (their defaults). Lock's timeoutMs is at offset 0.
_ARGS_BYTES = 256


class _Driver:
    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        self.failure: dict[str, Any] | None = None
        self.version = 0
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as error:
            self.failure = {"reason": "library", "error": f"cannot load libcuda.so.1: {error}"}
            return
        result = lib.cuInit(0)
        if result != 0:
            self.failure = {"reason": "init", "call": "cuInit", "code": result}
            self.failure["error"] = _error_text(lib, result)
            return
        version = ctypes.c_int(0)
        lib.cuDriverGetVersion(ctypes.byref(version))
        self.version = version.value
        missing = [name for name in CALLS if not hasattr(lib, name)]
        if missing:
            self.failure = {"reason": "symbols", "error": f"the driver lacks {missing}"}
        elif self.version < MIN_DRIVER_VERSION:
            self.failure = {
                "reason": "version",
                "error": f"driver API version {self.version} < {MIN_DRIVER_VERSION}",
            }
        self.lib = lib

    def state(self, pid: int) -> int | None:
        if self.lib is None or self.failure is not None:
            return None
        state = ctypes.c_int(-1)
        if self.lib.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(state)) != 0:
            return None
        return state.value

    def call(self, name: str, pid: int, timeout_ms: int = 0) -> dict[str, Any]:
        assert self.lib is not None
        args = ctypes.create_string_buffer(_ARGS_BYTES)
        if name == "cuCheckpointProcessLock":
            ctypes.c_uint.from_buffer(args, 0).value = timeout_ms
        start = time.perf_counter()
        result = getattr(self.lib, name)(ctypes.c_int(pid), args)
        seconds = time.perf_counter() - start
        if result != 0:
            return {
                "ok": False,
                "reason": "call",
                "call": name,
                "code": result,
                "error": _error_text(self.lib, result),
                "state": self.state(pid),
            }
        return {"ok": True, "seconds": seconds, "state": self.state(pid)}


def _error_text(lib: ctypes.CDLL, result: int) -> str:
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(result, ctypes.byref(name))
    lib.cuGetErrorString(result, ctypes.byref(text))
    decode = lambda s: s.value.decode() if s.value else "?"  # noqa: E731
    return f"{decode(name)}: {decode(text)}"


_OPS = {
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
}


_nvml: list[Any] = []  # dormant/memory/nvml.py, loaded at the first "memory" request


def memory(pid: int, pci_bus_id: str) -> dict[str, Any]:
    if not _nvml:
        import importlib.util

        spec = importlib.util.spec_from_file_location("nvml", Path(__file__).with_name("nvml.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _nvml.append(module)
    process_bytes, device = _nvml[0].read(pci_bus_id, pid)
    return {
        "ok": True,
        "process_bytes": process_bytes,
        "device_used_bytes": None if device is None else device.used_bytes,
        "device_total_bytes": None if device is None else device.total_bytes,
    }


def handle(driver: _Driver, request: dict[str, Any]) -> dict[str, Any]:
    op, pid = request.get("op"), int(request.get("pid", 0))
    if op == "memory":  # NVML, not the driver API: answered whatever the driver lacks
        return memory(pid, str(request["pci_bus_id"]))
    if driver.failure is not None:
        return {"ok": False, "state": None, **driver.failure}
    if op == "probe":
        return {"ok": True, "driver_version": driver.version, "state": driver.state(pid)}
    if op == "state":
        return {"ok": True, "state": driver.state(pid)}
    if op in _OPS:
        return driver.call(_OPS[op], pid, int(request.get("timeout_ms", 0)))
    return {"ok": False, "reason": "request", "error": f"unknown op {op!r}", "state": None}


def main() -> None:
    driver = _Driver()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = handle(driver, json.loads(line))
        except Exception as error:  # a bad request is answered, never the end of the helper
            reply = {"ok": False, "reason": "request", "error": repr(error), "state": None}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
