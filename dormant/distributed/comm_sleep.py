"""A tensor-parallel group's communicator memory, given back while the engine sleeps (issue 20).

An NCCL communicator holds device buffers (hundreds of MiB per rank at TP 2-8) that no tag owns,
so no sleep policy can free them. Two ways to give them back, chosen by ``comm_sleep``:

| mode         | sleep                                | wake                            |
|--------------|--------------------------------------|---------------------------------|
| ``suspend``  | ``ncclCommSuspend(comm, SUSPEND_MEM)`` | ``ncclCommResume(comm)``: the   |
|              | (NCCL >= 2.29.7)                     | communicator and its addresses  |
|              |                                      | stay, so captured graphs replay |
| ``recreate`` | the group's process group is         | a new one on the same ranks, in |
|              | destroyed                            | the same group object; refused  |
|              |                                      | where graphs captured its       |
|              |                                      | collectives (they would replay  |
|              |                                      | the destroyed communicator)     |
| ``off``      | nothing                              | nothing                         |

Both are collective: every rank of the group releases and restores together, as the engine's
sleep and wake commands run on every rank. ``recreate`` needs the group to be a subgroup (its
own process group, not torch's world group, which cannot be destroyed without ending the
process's ``torch.distributed``) spanning the whole world (making a group takes every rank).
What each call did, and the device memory it returned where it can be measured, comes back as
a ``CommSleepReport``.
"""

from __future__ import annotations

import ctypes
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dormant.distributed.communicator import NCCL_OWNER, warm_up
from dormant.distributed.parallel_state import DistributedTPGroup, TPGroup
from dormant.errors import EngineError
from dormant.memory.residual import ResidualLedger

NCCL_SUSPEND_MEM = 0x01  # nccl.h: release the communicator's device memory
SUSPEND_MIN_VERSION = (2, 29, 7)  # the first NCCL with ncclCommSuspend / ncclCommResume


class CommSleepError(EngineError):
    """A communicator could not be released or restored as asked."""


class CommSleepMode(enum.StrEnum):
    OFF = "off"
    SUSPEND = "suspend"
    RECREATE = "recreate"


@dataclass(frozen=True)
class CommSleepReport:
    """What one release or restore did on this rank. ``freed_bytes``: device memory returned
    (negative when taken back at restore), measured with ``cudaMemGetInfo`` around the call;
    None off the GPU."""

    action: str  # "suspended", "resumed", "destroyed", "recreated" or "none"
    reason: str
    freed_bytes: int | None
    seconds: float


class NcclSuspendApi:
    """``ncclCommSuspend`` / ``ncclCommResume`` of the NCCL library torch loaded, on a group's
    communicator."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._suspend, self._resume = library.ncclCommSuspend, library.ncclCommResume
        self._suspend.argtypes, self._resume.argtypes = (
            [ctypes.c_void_p, ctypes.c_int],
            [ctypes.c_void_p],
        )

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why suspend cannot be used here, or None when it can."""
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            return "no NCCL: communicators are suspended only on GPUs"
        version = torch.cuda.nccl.version()
        if tuple(version) < SUSPEND_MIN_VERSION:
            wanted = ".".join(map(str, SUSPEND_MIN_VERSION))
            return f"NCCL {'.'.join(map(str, version))} has no ncclCommSuspend (needs {wanted})"
        return None

    @classmethod
    def load(cls) -> NcclSuspendApi:
        reason = cls.unavailable_reason()
        if reason is not None:
            raise CommSleepError(f"comm_sleep='suspend' is unavailable: {reason}; use 'recreate'")
        return cls(ctypes.CDLL("libnccl.so.2"))  # the one torch loaded: dlopen returns it

    def suspend(self, group: DistributedTPGroup) -> None:
        _check(self._suspend(_comm(group), NCCL_SUSPEND_MEM), "ncclCommSuspend")

    def resume(self, group: DistributedTPGroup) -> None:
        _check(self._resume(_comm(group)), "ncclCommResume")


class CommunicatorSleep:
    """Releases and restores ``group``'s communicator by ``mode``; ``released`` in between.

    ``captures_collectives``: whether CUDA graphs captured this group's collectives (TP > 1
    with graphs), which ``recreate`` would break. ``api`` replaces the NCCL binding (tests).
    ``ledger``: the rank's residual, told what each release gave back and each restore took.
    """

    def __init__(
        self,
        group: TPGroup,
        mode: CommSleepMode | str,
        *,
        captures_collectives: bool = False,
        api: NcclSuspendApi | None = None,
        ledger: ResidualLedger | None = None,
    ) -> None:
        self.group, self.mode = group, CommSleepMode(mode)
        self.released = False
        self._api, self._ledger = api, ledger
        if self.mode is CommSleepMode.OFF or group.world_size == 1:
            return
        if not isinstance(group, DistributedTPGroup):
            raise CommSleepError(f"{group!r} has no communicator to release")
        if self.mode is CommSleepMode.RECREATE:
            if group.process_group is None:
                raise CommSleepError(
                    "comm_sleep='recreate' needs the TP group to be a subgroup: torch's world "
                    "group cannot be destroyed and made again within a process"
                )
            if group.world_size != dist.get_world_size():
                raise CommSleepError(
                    "comm_sleep='recreate' needs the engine to be the whole torch.distributed "
                    "world: making a group takes every rank of the world, and other engines "
                    "(data parallelism) sleep on their own; use 'suspend'"
                )
            if captures_collectives:
                raise CommSleepError(
                    "comm_sleep='recreate' with CUDA graphs at TP > 1: the graphs captured "
                    "the communicator it destroys; use enforce_eager=True, or 'suspend'"
                )
        elif self._api is None:
            self._api = NcclSuspendApi.load()

    @property
    def is_active(self) -> bool:
        """Whether sleep releases anything: a mode other than off, on more than one rank."""
        return self.mode is not CommSleepMode.OFF and self.group.world_size > 1

    def release(self) -> CommSleepReport:
        if self.released:
            raise CommSleepError("the communicator is released already: restore it first")
        if not self.is_active:
            return CommSleepReport("none", self._inactive_reason(), None, 0.0)
        group = self._distributed()
        if self.mode is CommSleepMode.SUSPEND:
            report = _measured("suspended", lambda: self._suspend_api.suspend(group))
        else:
            report = _measured("destroyed", lambda: dist.destroy_process_group(group.process_group))
        self.released = True
        self._account(report)
        return report

    def restore(self) -> CommSleepReport:
        if not self.released:
            return CommSleepReport("none", "the communicator was not released", None, 0.0)
        group = self._distributed()
        if self.mode is CommSleepMode.SUSPEND:
            report = _measured("resumed", lambda: self._suspend_api.resume(group))
        else:
            report = _measured("recreated", lambda: _recreate(group))
        self.released = False
        self._account(report)
        return report

    def _account(self, report: CommSleepReport) -> None:
        if self._ledger is not None:  # freed_bytes is None off the GPU: nothing is told
            self._ledger.returned(NCCL_OWNER, report.freed_bytes)

    @property
    def _suspend_api(self) -> NcclSuspendApi:
        assert self._api is not None  # loaded in __init__ for the suspend mode
        return self._api

    def _distributed(self) -> DistributedTPGroup:
        assert isinstance(self.group, DistributedTPGroup)  # checked in __init__
        return self.group

    def _inactive_reason(self) -> str:
        if self.mode is CommSleepMode.OFF:
            return "comm_sleep is off"
        return "a single rank has no communicator"


def _recreate(group: DistributedTPGroup) -> None:
    """A new process group on the destroyed one's ranks and backend, installed in ``group``
    in place: the layers hold ``group`` itself, so they use the new one from now on. Made by
    every rank of the world (checked in ``__init__``), so torch names it by its counter: a name
    hashed from the ranks would be the destroyed group's, and the new rendezvous could read
    the old one's keys. One collective makes its communicator now, inside the restore's
    measurement, rather than lazily in the first step after the wake."""
    group.process_group = dist.new_group(group.ranks, backend=group.backend)
    warm_up(group)


def _comm(group: DistributedTPGroup) -> int:
    """The ``ncclComm_t`` of the group's NCCL backend on this rank's device."""
    backend = dist.group.WORLD if group.process_group is None else group.process_group
    assert backend is not None
    nccl = backend._get_backend(torch.device("cuda", torch.cuda.current_device()))
    return int(nccl._comm_ptr())  # type: ignore[attr-defined]  # ProcessGroupNCCL only


def _measured(action: str, call: Callable[[], object]) -> CommSleepReport:
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    if on_gpu:
        torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0] if on_gpu else 0
    start = time.perf_counter()
    call()
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    freed = torch.cuda.mem_get_info()[0] - free_before if on_gpu else None
    return CommSleepReport(action, "", freed, seconds)


def _check(result: int, name: str) -> None:
    if result != 0:
        raise CommSleepError(f"{name} failed with ncclResult_t {result}")
