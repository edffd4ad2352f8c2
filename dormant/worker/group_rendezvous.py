"""Building a weight-update group, and the trainer's side of a plain update over it.

A group has ``world_size`` ranks: the trainer is rank 0 and engine TP rank ``t`` is
``rank_offset + t``. It is built the way SGLang, slime and OpenRLHF build theirs (a TCP
rendezvous on the trainer's ``master_address:master_port``, a ``PrefixStore`` named after the
group, torch's process-group helper), so a trainer using their ``init_custom_process_group``
can join it, and it never touches torch.distributed's default group, which the engine may use
for its own TP group.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as c10d

from dormant.worker.group_broadcasts import from_rank0, wait_for

DEFAULT_TIMEOUT_S = 60.0
BACKENDS = ("nccl", "gloo")


def create_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dist.ProcessGroup:
    """Joins (rank 0: hosts) the rendezvous and builds the group; both sides call this. Blocks
    until all ``world_size`` ranks joined or ``timeout_s`` passed."""
    timeout = timedelta(seconds=timeout_s)
    init_method = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=c10d.GroupName(group_name),
        timeout=timeout,
    )
    # Group rank == "global" rank, so torch.distributed.broadcast(..., src=0, group=g) works.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_weights(
    group: dist.ProcessGroup, named_tensors: Sequence[tuple[str, Tensor]], timeout_s: float
) -> None:
    """The trainer's side (rank 0) of a ``load_format=None`` update: broadcasts each tensor."""
    for _, tensor in named_tensors:
        wait_for(group.broadcast([tensor.contiguous()], from_rank0()), timeout_s)
