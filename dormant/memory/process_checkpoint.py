"""This process's whole CUDA state, its context included, checkpointed by the driver and restored.

The driver's process-checkpoint API (``cuCheckpointProcessLock`` / ``Checkpoint`` / ``Restore``
/ ``Unlock``, driver 570+) copies every device allocation of a process into host memory the driver
manages, then releases the process's GPU resources: the GPU shows nothing for it. Restore maps
everything back at the same addresses and recreates its contexts, streams and modules; unlock
lets its CUDA calls run again. The calls act on a PID from outside the target (a locked process
cannot make CUDA calls), so ``ProcessCheckpoint`` drives them through a small helper process
(``checkpoint_helper.py``), one JSON line per request, each reply awaited with a timeout: a
driver that never answers is an error, not a hang.

State of the target, as the driver reports it::

    RUNNING ──lock──▶ LOCKED ──checkpoint──▶ CHECKPOINTED ──restore──▶ LOCKED ──unlock──▶ RUNNING
    (a lock that times out leaves it RUNNING; a failed checkpoint is unlocked again, best effort)

Limits, from the driver's documentation: Linux x86-64; no UVM or IPC memory in the process; the
driver does not keep the process usable after an error mid-checkpoint (then the state is FAILED
and the engine must be restarted). NCCL communicators cannot survive it: ``nccl_groups`` finds
them and the callers refuse.
"""

from __future__ import annotations

import enum
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dormant.memory import nvml
from dormant.memory.errors import MemoryLayerError

HELPER = Path(__file__).with_name("checkpoint_helper.py")
MEMORY_TIMEOUT_S = 10.0


class ContextReleaseError(MemoryLayerError):
    """Base class of the errors of releasing and restoring the process's CUDA state."""


class CheckpointUnsupportedError(ContextReleaseError):
    """The driver cannot checkpoint this process (no libcuda, a driver before 570, no such API,
    a client of an MPS server); nothing was changed."""


class CommunicatorActiveError(ContextReleaseError):
    """The process has an NCCL communicator, which cannot be checkpointed safely; nothing was
    changed."""


class CheckpointFailedError(ContextReleaseError):
    """A checkpoint call failed; the message names it, the CUDA error and the process's state.

    Attributes:
        state: the process's ``ProcessState`` after the failure (None when unknown).
    """

    def __init__(self, message: str, state: ProcessState | None = None) -> None:
        super().__init__(message)
        self.state = state

    def __reduce__(self) -> tuple[type, tuple[str, ProcessState | None]]:
        return type(self), (str(self), self.state)


class CheckpointTimeoutError(CheckpointFailedError):
    """The helper did not answer in time; it was killed."""


class ContextReleasedError(ContextReleaseError):
    """A call needs the device while the process's CUDA state is checkpointed."""


class ProcessState(enum.Enum):
    """``CUprocessState``."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3  # an uncorrectable error mid-checkpoint or mid-restore: restart the process
    CHECKPOINTING = 4
    RESTORING = 5


class ProcessCheckpoint:
    """Checkpoints and restores one process (this one by default) through a helper process.

    ``lock_timeout_s`` bounds the driver's wait for the target's running CUDA calls (the lock
    fails and leaves the target RUNNING after it); ``reply_timeout_s`` bounds each helper reply
    (on an H200, driver 580: a bare context in 0.34 s, 8 GiB held in 9.8 s, an asleep engine's
    756 MiB in 0.51 s; ``benchmarks/context_release.py``).
    """

    def __init__(
        self,
        pid: int | None = None,
        *,
        lock_timeout_s: float = 30.0,
        reply_timeout_s: float = 300.0,
    ) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.lock_timeout_s = lock_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.driver_version: int | None = None
        self._helper: subprocess.Popen[bytes] | None = None
        self._pending = b""

    # ── the operations ────────────────────────────────────────────────────────────────────────
    def probe(self) -> ProcessState | None:
        """Checks that the driver can checkpoint the target; returns its state. Raises
        CheckpointUnsupportedError (changing nothing) when it cannot. (None: the driver could
        not say.)"""
        reply = self._request({"op": "probe"}, timeout_s=60.0)
        if not reply["ok"]:
            raise CheckpointUnsupportedError(
                f"the CUDA driver cannot checkpoint process {self.pid}: {reply.get('error')}. "
                "Releasing the CUDA context needs Linux and display driver 570 or later (CUDA "
                "12.8's cuCheckpointProcess* API); sleep without release_context instead."
            )
        self.driver_version = int(reply["driver_version"])
        return _state(reply)

    def checkpoint(self) -> float:
        """Locks the target, then checkpoints it; returns the seconds both took. On failure
        the target is unlocked again where it was locked, and CheckpointFailedError says what
        its state is."""
        start = time.perf_counter()
        timeout_ms = max(1, int(self.lock_timeout_s * 1000))
        self._call("lock", self.lock_timeout_s + 30.0, timeout_ms=timeout_ms)
        try:
            self._call("checkpoint", self.reply_timeout_s)
        except CheckpointFailedError as error:
            if error.state is ProcessState.LOCKED:
                self._call("unlock", 60.0)
                error.state = ProcessState.RUNNING
            raise
        return time.perf_counter() - start

    def restore(self) -> float:
        """Restores the target from its checkpoint and unlocks it; returns the seconds."""
        start = time.perf_counter()
        if self.state() is ProcessState.CHECKPOINTED:
            self._call("restore", self.reply_timeout_s)
        self._call("unlock", 60.0)
        return time.perf_counter() - start

    def state(self) -> ProcessState | None:
        return _state(self._request({"op": "state"}, timeout_s=60.0))

    def memory(self, pci_bus_id: str) -> nvml.Reading:
        """NVML's figures for the target and its device, read by the helper: the target cannot
        read them itself while locked (its NVML calls block too). Unknown (never an error)
        when the helper cannot say in ``MEMORY_TIMEOUT_S``."""
        try:
            reply = self._request({"op": "memory", "pci_bus_id": pci_bus_id}, MEMORY_TIMEOUT_S)
        except ContextReleaseError:
            return nvml.UNKNOWN
        used, total = reply.get("device_used_bytes"), reply.get("device_total_bytes")
        device = None if used is None or total is None else nvml.DeviceMemory(used, total)
        return nvml.Reading(reply.get("process_bytes"), device)

    def close(self) -> None:
        """Ends the helper (the target's state is left as it is)."""
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.kill()
            helper.wait()
            for stream in (helper.stdin, helper.stdout):
                if stream is not None:
                    stream.close()

    # ── the helper ────────────────────────────────────────────────────────────────────────────
    def _call(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        reply = self._request({"op": op, **fields}, timeout_s)
        if not reply["ok"]:
            state = _state(reply)
            raise CheckpointFailedError(
                f"{reply.get('call', op)} on process {self.pid} failed: {reply.get('error')}; "
                f"the process's CUDA state is now {_name(state)}",
                state,
            )
        return reply

    def _request(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        helper = self._start()
        assert helper.stdin is not None
        try:
            helper.stdin.write((json.dumps({**request, "pid": self.pid}) + "\n").encode())
            helper.stdin.flush()
            line = self._read_line(helper, timeout_s)
        except (BrokenPipeError, ChildProcessError) as error:
            self.close()
            raise CheckpointFailedError(
                f"the checkpoint helper died during {request['op']!r} ({error}); the process's "
                "CUDA state is unknown"
            ) from error
        return dict(json.loads(line))

    def _start(self) -> subprocess.Popen[bytes]:
        if self._helper is None or self._helper.poll() is not None:
            self._pending = b""
            self._helper = subprocess.Popen(
                [sys.executable, "-I", "-S", str(HELPER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        return self._helper

    def _read_line(self, helper: subprocess.Popen[bytes], timeout_s: float) -> bytes:
        assert helper.stdout is not None
        fd, deadline = helper.stdout.fileno(), time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                self.close()
                raise CheckpointTimeoutError(
                    f"the checkpoint helper gave no answer in {timeout_s:.0f} s and was killed; "
                    f"process {self.pid}'s CUDA state is unknown (the driver may still be "
                    "working on it)"
                )
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ChildProcessError(f"exit status {helper.wait()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line


def nccl_groups() -> list[str]:
    """The torch.distributed process groups of this process with an NCCL backend, by name
    (weight-update groups and tensor-parallel groups alike)."""
    try:
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return []
    world = getattr(c10d, "_world", None)
    groups = dict(getattr(world, "pg_map", {}) or {})
    names = dict(getattr(world, "pg_names", {}) or {})
    return [
        str(names.get(group, "?"))
        for group, (backend, _) in groups.items()
        if "nccl" in str(backend).lower()
    ]


def _state(reply: dict[str, Any]) -> ProcessState | None:
    value = reply.get("state")
    return None if value is None else ProcessState(int(value))


def _name(state: ProcessState | None) -> str:
    return "unknown" if state is None else state.name
