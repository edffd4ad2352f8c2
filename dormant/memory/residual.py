"""The residual: device memory in use, by owner, with measured figures only (DESIGN §5).

``memory_status().residual`` partitions the device memory in use into owners; the rows add up to
the device's used bytes exactly. On CUDA each row is measured this way:

| row                                  | how it is measured                                      |
|--------------------------------------|---------------------------------------------------------|
| dormant tag ``t``                    | the manager's own records: physical memory it holds     |
| torch: live tensors outside the tags | torch's segment snapshot, the tags' pool segments left  |
|                                      | out (``torch_usage.py``)                                |
| torch: cached outside the tags       | the same segments' size less their live blocks          |
| CUDA context (the manager's start)   | this process's memory then (NVML), less torch's and the |
|                                      | tags'                                                   |
| grew while <phase>                   | the same difference at each phase the engine marks      |
|                                      | (``mark``): CUDA/Triton modules loaded, cuBLAS handles, |
|                                      | graph executables, the context's local memory           |
| <owner> (a phase marked with one)    | the same difference, for a phase that made one thing:   |
|                                      | the TP group's NCCL communicator (``mark(..., owner=)``,|
|                                      | or ``carve`` when it was made before the manager), less |
|                                      | what it gave back while asleep (``returned``)           |
| grew since <last phase>              | the same, now (modules loaded lazily by later steps)    |
| other processes on this device       | the device's used bytes (cuMemGetInfo) less this        |
|                                      | process's (NVML)                                        |

"This process" is NVML's per-process accounting (``nvml.py``). Without it (no NVML, or a PID
namespace that hides our pid) the process rows fall back to the device's used bytes and say
that other processes are included. What the last sleep gave back beyond the tags (cuBLAS
workspaces, torch's cache; ``torch_usage.release_torch_memory``; the context's local memory,
``local_memory.py``) is reported beside the rows, since it is no longer in use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dormant.memory import nvml
from dormant.memory.blocks import BlockTable
from dormant.memory.local_memory import LocalMemory
from dormant.memory.serial import SerialSection
from dormant.memory.status import ResidualItem
from dormant.memory.torch_usage import (
    TorchRelease,
    TorchUsage,
    release_torch_memory,
    torch_outside_tags,
)

MODULES = (
    "the context's local memory (thread stacks), CUDA/Triton modules, cuBLAS handles, graph "
    "executables, driver state"
)


@dataclass(frozen=True)
class Sample:
    """The device's memory at one moment, split as far as measurement allows."""

    label: str
    device_used_bytes: int
    device_total_bytes: int
    process_bytes: int | None  # NVML's figure for this process; None when unknown
    torch: TorchUsage
    tag_held_bytes: int
    stack_bytes: int | None  # the context's per-thread stack limit (local memory grows with it)
    owner: str | None = None  # what the phase ending here made, when it made one thing

    @property
    def other_bytes(self) -> int:
        """This process's device memory that is neither torch's nor the tags' (without NVML:
        the device's, other processes included)."""
        whole = self.device_used_bytes if self.process_bytes is None else self.process_bytes
        return whole - self.torch.reserved_bytes - self.tag_held_bytes


class ResidualLedger:
    """Samples taken when the manager starts and at each phase its user marks, and the last
    release of torch's memory: a manager's ``mm.residual``. Only the cuda backend is sampled
    (elsewhere there is no driver state to account). ``mark`` takes the manager's lock;
    ``items`` is called under it."""

    def __init__(self, table: BlockTable, serial: SerialSection) -> None:
        self._table, self._serial = table, serial
        self.device = table.backend.device
        self.is_cuda = self.device.type == "cuda"
        self._pci_bus_id = pci_bus_id_of(self.device.index) if self.is_cuda else None
        # NVML must list us now (we have a context): a PID namespace can hide our pid from it
        listed = nvml.compute_processes(self._pci_bus_id) if self._pci_bus_id else None
        self._is_listed = listed is not None and os.getpid() in listed
        self.samples: list[Sample] = [self.sample("the manager started")] if self.is_cuda else []
        self.last_release: TorchRelease | None = None
        self.local_memory = LocalMemory(self.device)
        self._returned: dict[str, int] = {}  # owner -> bytes it gave back since it was made
        self._carved: dict[str, int] = {}  # owner -> bytes of the first sample that are its

    def sample(self, label: str, owner: str | None = None) -> Sample:
        free, total = self._table.backend.memory_info()
        return Sample(
            label=label,
            owner=owner,
            device_used_bytes=total - free,
            device_total_bytes=total,
            process_bytes=self.process_bytes(),
            torch=torch_outside_tags(self.device, tag_segments(self._table)),
            tag_held_bytes=held_bytes(self._table),
            stack_bytes=_stack_limit(),
        )

    def mark(self, label: str, owner: str | None = None) -> None:
        """Samples now: what grew since the previous mark is reported as grown "while <label>"
        (an engine marks its start-up phases: model loaded, graphs captured), or as ``owner``'s
        when the phase made one thing (the TP group's NCCL communicator)."""
        if self.is_cuda:
            with self._serial.held():
                self.samples.append(self.sample(label, owner))

    def carve(self, owner: str, nbytes: int | None) -> None:
        """``nbytes`` of the memory in use when the manager started are ``owner``'s, measured by
        the caller before the manager existed (a communicator an earlier collective made): its
        own row, out of the context's. ``None``: not measured."""
        if nbytes is not None and self.is_cuda and self.samples:
            with self._serial.held():
                self._carved[owner] = self._carved.get(owner, 0) + nbytes

    def returned(self, owner: str, nbytes: int | None) -> None:
        """``owner`` (a marked one) gave back ``nbytes`` of device memory (negative: took it
        back), e.g. a communicator suspended while asleep: its row shrinks by that, and the
        "since" row, whose sample saw the memory go, grows by it. ``None``: not measured."""
        if nbytes is not None and self.is_cuda:
            with self._serial.held():
                self._returned[owner] = self._returned.get(owner, 0) + nbytes

    def release_torch_memory(self) -> TorchRelease | None:
        """Frees torch's cuBLAS workspaces and returns its unused cache (``torch_usage.py``);
        the status reports what it gave back. Call it between steps, after a sleep.

        Not under the manager's lock: ``empty_cache`` may free a pool segment, whose free comes
        back through ``raw_free``, which takes the lock.
        """
        self.last_release = release_torch_memory(self.device)
        return self.last_release

    def release_local_memory(self) -> None:
        """Gives the context's local-memory reservation back (``local_memory.py``); call it
        after a sleep, after ``release_torch_memory``. ``restore_local_memory`` at the wake."""
        with self._serial.held():
            self.local_memory.release()

    def restore_local_memory(self) -> None:
        with self._serial.held():
            self.local_memory.restore()

    @property
    def is_listed(self) -> bool:
        """Whether NVML listed this process's pid when the manager started (with a context): a
        PID namespace hides it."""
        return self._is_listed

    def process_bytes(self) -> int | None:
        """NVML's figure for this process on the device (None when unknown: no NVML, or it did
        not list this process when the manager started, with a context). Not while the
        process's CUDA state is locked: its own NVML calls block then (``mm.context``'s
        ``outside_reading`` reads through the checkpoint helper instead)."""
        if self._pci_bus_id is None or not self._is_listed:
            return None
        return nvml.process_memory(self._pci_bus_id, os.getpid())

    @property
    def pci_bus_id(self) -> str | None:
        """The device's PCI bus id (what NVML knows it by); None off CUDA."""
        return self._pci_bus_id

    def device_memory(self) -> nvml.DeviceMemory | None:
        return None if self._pci_bus_id is None else nvml.device_memory(self._pci_bus_id)

    def items(self) -> tuple[Sample, list[ResidualItem]]:
        """The rows beyond the tags' (see the module docstring), measured now, and the sample
        they were measured from: with the tags' rows they add up to its used bytes."""
        now = self.sample("now")
        with_nvml = now.process_bytes is not None
        who = "this process" if with_nvml else "this process and any other on the device"
        rows = [
            ResidualItem("torch: live tensors outside dormant's tags", now.torch.allocated_bytes),
            ResidualItem(
                "torch: cached outside dormant's tags (reserved, unused)", now.torch.cached_bytes
            ),
        ]
        owned = dict(self._carved)  # owner -> bytes it took when it was made
        previous: Sample | None = None
        for sample in [*self.samples, now]:
            if previous is None:
                owner = f"CUDA context and other non-torch memory of {who} when {sample.label}"
                rows.append(ResidualItem(owner, sample.other_bytes - sum(self._carved.values())))
            else:
                grown = sample.other_bytes - previous.other_bytes
                if sample.owner is not None:
                    owned[sample.owner] = owned.get(sample.owner, 0) + grown
                else:
                    span = f"since {previous.label}" if sample is now else f"while {sample.label}"
                    stack = _stack_change(previous, sample)
                    if sample is now:  # what the owners gave back is missing from now's sample
                        grown += sum(self._returned.values())
                    rows.append(ResidualItem(f"grew {span}: {MODULES}{stack}", grown))
            previous = sample
        rows += [self._owned(owner, nbytes) for owner, nbytes in owned.items()]
        if with_nvml:
            assert now.process_bytes is not None
            rows.append(
                ResidualItem(
                    "other processes on this device (NVML)",
                    now.device_used_bytes - now.process_bytes,
                )
            )
        return now, [r for r in rows if r.nbytes]

    def _owned(self, owner: str, nbytes: int) -> ResidualItem:
        """``owner``'s row: what it took when it was made, less what it gave back since."""
        returned = self._returned.get(owner, 0)
        if returned:
            return ResidualItem(
                f"{owner} ({returned / 2**20:.1f} MiB of it given back while asleep)",
                nbytes - returned,
            )
        return ResidualItem(owner, nbytes)

    def released_items(self) -> list[ResidualItem]:
        """What the last sleep gave back beyond the tags."""
        release, local = self.last_release, self.local_memory.last_release
        items = []
        if release is not None:
            items += [
                ResidualItem(
                    "cuBLAS workspaces freed by the last sleep", release.cublas_workspace_bytes
                ),
                ResidualItem("torch cache returned by the last sleep", release.cache_bytes),
            ]
        if local is not None:
            items.append(
                ResidualItem(
                    "the context's local memory (thread stacks), last sleep", local.freed_bytes
                )
            )
        return items


def tag_segments(table: BlockTable) -> list[int]:
    """Addresses of the manager's raw blocks: the segments of the tags' torch pools."""
    return [r.address for r in table.records() if r.kind == "raw"]


def held_bytes(table: BlockTable) -> int:
    """Device memory the manager's allocations hold, with those whose free failed."""
    return sum(a.size for a in table.allocations() if a.handle is not None) + table.unfreed_bytes


def _stack_change(before: Sample, after: Sample) -> str:
    if before.stack_bytes is None or after.stack_bytes in (None, before.stack_bytes):
        return ""
    given_back = ": the local memory given back" if after.stack_bytes == 0 else ""
    return f" (per-thread stack limit {before.stack_bytes} -> {after.stack_bytes} B{given_back})"


def pci_bus_id_of(index: int | None) -> str | None:
    """The PCI bus id of CUDA device ``index`` (what NVML knows it by), read without creating a
    context; None when the driver cannot say."""
    from dormant.memory.cuda_driver import call

    try:
        call("cuInit", 0)
        device = call("cuDeviceGet", 0 if index is None else index)
        raw = call("cuDeviceGetPCIBusId", 32, device)
    except Exception:
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.split("\x00", 1)[0] or None


def _stack_limit() -> int | None:
    from dormant.memory.cuda_driver import call, driver

    try:
        return int(call("cuCtxGetLimit", driver().CUlimit.CU_LIMIT_STACK_SIZE))
    except Exception:
        return None
