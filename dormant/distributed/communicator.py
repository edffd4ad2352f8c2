"""The tensor-parallel group's NCCL communicator, made at the worker's start and attributed.

torch's ``ProcessGroupNCCL`` makes its communicator lazily, at the group's first collective, and
that communicator's device buffers (hundreds of MiB per rank at TP 2-8) belong to no tag. Left
lazy, they land in whichever start-up phase ran the first collective, mixed with kernels and
graph executables. ``create_communicator`` runs one collective right after the worker's memory
manager starts, between two residual marks, so ``memory_status().residual`` shows the
communicator as its own row (``NCCL_OWNER``), measured. While it is suspended or destroyed
(``comm_sleep.py``) the row shrinks by what that gave back (``ResidualLedger.returned``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dormant.distributed.parallel_state import DistributedTPGroup, TPGroup
from dormant.memory.residual import ResidualLedger

NCCL_OWNER = "NCCL communicator of the tensor-parallel group (measured when it was made)"


def is_nccl(group: TPGroup) -> bool:
    """Whether ``group`` runs its collectives through an NCCL communicator."""
    return isinstance(group, DistributedTPGroup) and group.backend == "nccl"


def warm_up(group: DistributedTPGroup) -> None:
    """One collective on the group, waited for: it makes the communicator if it is not made."""
    device = torch.device("cuda", torch.cuda.current_device()) if is_nccl(group) else None
    dist.all_reduce(torch.zeros(1, device=device), group=group.process_group)
    if device is not None:
        torch.cuda.synchronize(device)


def create_communicator(group: TPGroup, ledger: ResidualLedger) -> bool:
    """Makes ``group``'s NCCL communicator now and marks its device memory as ``NCCL_OWNER``'s.

    Returns whether it did (False for a single rank, gloo, or any group without NCCL). Every
    rank of the group calls it at the same point of its start-up: it is a collective.
    """
    if not is_nccl(group):
        return False
    assert isinstance(group, DistributedTPGroup)  # is_nccl checked it
    ledger.mark("the worker started")
    warm_up(group)
    ledger.mark("the tensor-parallel group's communicator was made", owner=NCCL_OWNER)
    return True
