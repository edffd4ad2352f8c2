"""The manager's side of releasing this process's CUDA state (``process_checkpoint.py``).

    release: refuse (NCCL communicators; an MPS client; a driver that cannot) ─▶ synchronize
             ─▶ pause the garbage collector ─▶ lock + checkpoint (helper) ─▶ released
    while released: every manager call that needs the device raises ContextReleasedError at
             once instead of blocking in the locked driver; frees of tensors that die meanwhile
             wait, and run right after the restore; status() has NVML's figures, read by the
             helper (this process's own NVML calls block while it is locked)
    restore (wake_up does it first): restore + unlock (helper) ─▶ the collector runs again
             ─▶ the waiting frees run

Refusals come before anything changes. An MPS client is refused by NVML's list of them (the
driver's lock answers CUDA_ERROR_NOT_SUPPORTED for one, seen on an H100 with driver 580, once the
tags were already asleep); behind a PID namespace NVML does not show this process's pid, and the
lock's typed error is what remains. A listed pid equal to this process's counts only where this
process can reach an MPS pipe folder, as every client must: otherwise it is another namespace's.
A checkpoint that fails leaves the process unlocked where the driver allows it, and the error
says what state it is in. The garbage collector is paused while released because a tensor freed
by a collection makes a CUDA call (an event record, a free), which would block its thread in the
locked driver: that thread could be the one that must call wake. (Collecting first instead costs
a full collection, 0.4 s in a test process.)
"""

from __future__ import annotations

import atexit
import gc
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from dormant.memory import nvml
from dormant.memory.backend import Backend
from dormant.memory.capture import check_not_capturing
from dormant.memory.process_checkpoint import (
    CheckpointUnsupportedError,
    CommunicatorActiveError,
    ContextReleasedError,
    ProcessCheckpoint,
    nccl_groups,
)
from dormant.memory.serial import SerialSection
from dormant.memory.status import ContextReport


class Readings(Protocol):
    """What the manager's residual ledger (``residual.ResidualLedger``) tells the release."""

    @property
    def pci_bus_id(self) -> str | None: ...

    @property
    def is_listed(self) -> bool: ...

    def process_bytes(self) -> int | None: ...


class ContextRelease:
    """Whether this process's CUDA state is checkpointed, and what waits for its restore: a
    manager's ``mm.context``. ``release``, ``restore`` and ``check`` take the manager's lock;
    ``check_usable`` and ``defer`` are called by the manager under it.

    Invariant: ``_pending`` is empty unless the context is released.
    """

    def __init__(self, serial: SerialSection, backend: Backend, readings: Readings) -> None:
        self._serial, self._backend, self._readings = serial, backend, readings
        self._checkpoint: ProcessCheckpoint | None = None
        self._gc_was_enabled = False
        atexit.register(_restore_at_exit, weakref.ref(self))
        self.last: ContextReport | None = None
        self._pending: list[Callable[[], None]] = []

    @property
    def is_released(self) -> bool:
        return self.last is not None and self.last.is_released

    def check_usable(self, what: str) -> None:
        if self.is_released:
            raise ContextReleasedError(
                f"{what} needs the device, and this process's CUDA state is checkpointed by the "
                "driver (sleep with release_context); call wake_up() first, which restores it"
            )

    def check(self, checkpoint: ProcessCheckpoint | None = None) -> None:
        """Raises CommunicatorActiveError or CheckpointUnsupportedError if ``release`` would be
        refused now (changing nothing). ``checkpoint``: the checkpointer to use from now on
        (default: one of this process)."""
        with self._serial.held():
            if not self.is_released:
                self._checked(checkpoint)

    def _checked(self, checkpoint: ProcessCheckpoint | None) -> ProcessCheckpoint:
        groups = nccl_groups()
        if groups:
            raise CommunicatorActiveError(
                f"this process has NCCL communicators ({groups}); the driver cannot checkpoint "
                "them safely. Destroy them first (destroy_weights_update_group), or sleep "
                "without release_context; a tensor-parallel engine cannot release its context."
            )
        bus = self._readings.pci_bus_id
        clients = nvml.mps_clients(bus) if bus is not None and reaches_mps_pipe() else None
        if clients and os.getpid() in clients:
            raise CheckpointUnsupportedError(
                f"process {os.getpid()} runs on the GPU as a client of an MPS server, and the "
                "driver cannot checkpoint an MPS client; sleep without release_context (the "
                "engine then keeps its CUDA context), or run the engine without MPS"
            )
        if checkpoint is not None and checkpoint is not self._checkpoint:
            self.close()
        self._checkpoint = checkpoint or self._checkpoint or ProcessCheckpoint()
        self._checkpoint.probe()
        return self._checkpoint

    def release(self, checkpoint: ProcessCheckpoint | None = None) -> ContextReport:
        """Checkpoints this process's whole CUDA state, its context included: the GPU then
        shows nothing for it. Until ``restore`` (``wake_up`` does it first) every manager call
        that needs the device raises ContextReleasedError. A no-op when released already.

        Sleep the tags first: what is still mapped is copied by the driver, at its own speed.
        Any other CUDA call made in this process meanwhile (another library's, another
        thread's) blocks until the restore: release only a process that waits for its wake.
        """
        check_not_capturing("release_context()")
        with self._serial.held():
            if self.last is not None and self.last.is_released:
                return self.last
            checkpointer = self._checked(checkpoint)
            self._backend.synchronize()
            before = self._readings.process_bytes()
            self._gc_was_enabled = gc.isenabled()
            gc.disable()  # no collection may free a tensor (a CUDA call) while it is locked
            try:
                seconds = checkpointer.checkpoint()
            except BaseException:
                self._enable_gc()
                raise
            released = self.outside_reading().process_bytes
            self.last = ContextReport(True, seconds, None, before, released)
            return self.last

    def outside_reading(self) -> nvml.Reading:
        """NVML's figures for this process and its device, read by the helper: safe while the
        process is locked, when its own NVML calls would block (call it under the manager's
        lock, with a checkpointer: after a ``check`` or ``release``)."""
        bus, checkpointer = self._readings.pci_bus_id, self._checkpoint
        if bus is None or checkpointer is None:
            return nvml.UNKNOWN
        reading = checkpointer.memory(bus)
        if not self._readings.is_listed:  # a PID namespace: our pid is not the one NVML lists
            reading = reading._replace(process_bytes=None)
        return reading

    def restore(self) -> ContextReport | None:
        """Restores the CUDA state if it is released (None otherwise), then runs the frees
        that waited for it."""
        with self._serial.held():
            if self.last is None or not self.last.is_released:
                return None
            assert self._checkpoint is not None
            start = time.perf_counter()
            self._checkpoint.restore()
            restored = replace(self.last, is_released=False, restore_s=time.perf_counter() - start)
            self.last = restored  # unlocked: this process may read NVML again
            self.last = replace(restored, process_bytes_restored=self._readings.process_bytes())
            self._enable_gc()
            pending, self._pending = self._pending, []
            for work in pending:
                work()
            return self.last

    def _enable_gc(self) -> None:
        if self._gc_was_enabled:
            gc.enable()

    def defer(self, work: Callable[[], None]) -> bool:
        """Keeps ``work`` (a free) for after the restore if the context is released; returns
        whether it did."""
        if not self.is_released:
            return False
        self._pending.append(work)
        return True

    def close(self) -> None:
        """Ends the helper process. Precondition: the context is not released."""
        if self._checkpoint is not None:
            self._checkpoint.close()
            self._checkpoint = None


def _restore_at_exit(ref: weakref.ref[ContextRelease]) -> None:
    """A process that exits while released would block in the locked driver as it tears CUDA
    down: it is restored first."""
    context = ref()
    if context is not None and context.is_released:
        context.restore()


MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"  # the pipe folder when CUDA_MPS_PIPE_DIRECTORY is unset


def reaches_mps_pipe() -> bool:
    """Whether this process could be an MPS client at all: a client reaches its control daemon
    through the pipe folder, ``CUDA_MPS_PIPE_DIRECTORY`` or the default."""
    return bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) or os.path.isdir(MPS_DEFAULT_PIPE)
