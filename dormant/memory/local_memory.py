"""The CUDA context's local-memory reservation, given back while asleep (issue 17, section 4).

The driver backs every thread's local memory (its stack and register spills) with one device
reservation, sized for the most threads the device can run at once times the per-thread size
the context needs. That size grows with the kernels launched, and once a CUDA graph has been
instantiated the context keeps it at its largest (``CU_CTX_LMEM_RESIZE_TO_MAX`` appears in its
flags). So it is residual no sleep of the tags can free: on the H200, in a fresh process
(``benchmarks/residual_sources.py``, 2026-12-02c run 2), the first torch kernel grew the process's
device memory by 92 MiB, the first cuBLAS GEMM by 66 MiB and the first graph by 70 MiB, none of it
torch's or the tags'; setting the per-thread stack limit to 0 gave back 264 MiB, more than all
three, and torch kernels and GEMMs launched after it ran. The driver API documents why that is
safe: it "automatically increases the per-thread stack size for each kernel launch as needed",
and setting the limit "will take effect immediately, and if necessary, the device will block
until all preceding requested tasks are complete" (``cuCtxSetLimit``).

``LocalMemory.release`` (at sleep, after everything else) sets ``CU_LIMIT_STACK_SIZE`` to 0 and
measures what the device got back; ``restore`` (at the first wake) sets the limit the context had
before, so that an awake engine runs with exactly the context it captured its graphs in.
Setting the limit waits for the device's work, so both run where the device is idle: after the
sleep's synchronisation, and after the wake's copies (a kernel launched in between, a refit's or
a colocated trainer's, gets the local memory it needs from the driver). Off CUDA both do
nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from dormant.memory.cuda_driver import call, driver
from dormant.memory.errors import DriverError

logger = logging.getLogger("dormant.memory")


@dataclass(frozen=True)
class LocalMemoryRelease:
    """What one ``LocalMemory.release`` gave back."""

    stack_limit_bytes: int  # the per-thread stack limit before (what ``restore`` sets again)
    freed_bytes: int  # the drop in the device's used memory across the change
    seconds: float


class LocalMemory:
    """The local-memory reservation of ``device``'s context (see the module)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.last_release: LocalMemoryRelease | None = None
        self._saved_limit: int | None = None  # set while released

    @property
    def is_released(self) -> bool:
        return self._saved_limit is not None

    def release(self) -> LocalMemoryRelease | None:
        """Drops the reservation (the stack limit to 0); returns what came back, None off CUDA,
        when it is already released, or when the driver refuses (logged: the sleep itself
        succeeded, only the reservation stays)."""
        if not self.is_cuda or self.is_released or not torch.cuda.is_initialized():
            return None
        with torch.cuda.device(self.device):
            start = time.perf_counter()
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            try:
                limit = _stack_limit()
                _set_stack_limit(0)
            except DriverError as error:
                logger.warning("the CUDA context's local memory stays reserved: %s", error)
                return None
            self._saved_limit = limit
            freed = torch.cuda.mem_get_info()[0] - free_before
        self.last_release = LocalMemoryRelease(limit, freed, time.perf_counter() - start)
        return self.last_release

    def restore(self) -> None:
        """Sets the stack limit the context had before ``release`` (nothing if not released)."""
        if self._saved_limit is None:
            return
        limit, self._saved_limit = self._saved_limit, None
        with torch.cuda.device(self.device):
            try:
                _set_stack_limit(limit)
            except DriverError as error:  # launches still grow the stack as they need it
                logger.warning("the stack limit %d B could not be set again: %s", limit, error)


def _stack_limit() -> int:
    return int(call("cuCtxGetLimit", driver().CUlimit.CU_LIMIT_STACK_SIZE))


def _set_stack_limit(nbytes: int) -> None:
    call("cuCtxSetLimit", driver().CUlimit.CU_LIMIT_STACK_SIZE, nbytes)
