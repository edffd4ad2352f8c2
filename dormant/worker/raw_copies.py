"""A copy plan's byte runs on a CUDA device, issued to the driver: one ``cuMemcpyAsync`` each.

A refit of a kept plan spends more on the host than the copy takes on the device when it goes
through torch: per run a slice of the bucket, a view, ``copy_``'s dispatch, then a
``torch.cuda.current_stream`` lookup and its ``synchronize`` (some 30-60 us a bucket on the H200's
host, beside a 0.26 ms copy of 512 MiB). The plan's destinations and offsets never change while
it is valid, so ``RawRuns`` keeps each run as three integers and issues it straight to the
driver, on this thread's current stream (the one torch's copies, and the wait on the sender's
event, use)::

    run                         address read                      when
    ──────────────────────────  ────────────────────────────────  ───────────────────────────────
    destination                 the parameter storage's, at build  the plan is used only while
                                                                  ``CopyPlan.is_valid_for``
    source                      the bucket's data pointer, each    every call (a new handle may
                                call, plus the run's offset        map it elsewhere)

Only plans whose every step is a byte run (no cast, no strided source, no loader) on one CUDA
device have them. The caller checks the bucket's length against the plan (``CopyPlan.run``) and
``can_copy`` before issuing; otherwise the plan's steps run through torch. With ``ENABLED`` off
no plan gets them (the benchmarks time both ways in one process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dormant.memory.cuda_driver import call

ENABLED = True  # module-level so that a benchmark compares against torch's copies


@dataclass(frozen=True)
class RawRuns:
    """The byte runs of a plan on CUDA device ``device_index``: (destination address, source
    offset in the bucket, bytes)."""

    device_index: int
    runs: tuple[tuple[int, int, int], ...]

    def can_copy(self, flat_bytes: Tensor) -> bool:
        """Whether the bucket is on this device and the device is current (a driver call needs
        its context current; a worker's device always is)."""
        index = self.device_index
        return flat_bytes.get_device() == index and torch.cuda.current_device() == index

    def issue_and_wait(self, flat_bytes: Tensor) -> None:
        """Copies every run out of ``flat_bytes`` (a contiguous uint8 tensor on this device,
        long enough: the caller checked) and returns once the copies finished, so that the
        sender may reuse or free its buffer. Raises ``DriverError`` when a call fails."""
        self.issue(flat_bytes)
        self.wait()

    def issue(self, flat_bytes: Tensor) -> None:
        """Enqueues every run's copy on the current stream."""
        base = flat_bytes.data_ptr()
        stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        for destination, offset, nbytes in self.runs:
            call("cuMemcpyAsync", destination, base + offset, nbytes, stream)

    def wait(self) -> None:
        """Returns once the current stream's work finished."""
        call("cuStreamSynchronize", torch._C._cuda_getCurrentRawStream(self.device_index))


def raw_runs_of(runs: Sequence[tuple[Tensor, int, int]]) -> RawRuns | None:
    """``RawRuns`` for a plan's steps as (destination uint8 view, source offset, bytes), or None
    when there are none, a destination is not a CUDA byte view of that size, or they span
    devices."""
    if not ENABLED or not runs:
        return None
    devices = {destination.device for destination, _, _ in runs}
    device = devices.pop()
    if devices or device.type != "cuda" or device.index is None:
        return None
    if not all(d.dtype == torch.uint8 and d.numel() == n and d.is_contiguous() for d, _, n in runs):
        return None
    return RawRuns(device.index, tuple((d.data_ptr(), offset, n) for d, offset, n in runs))
