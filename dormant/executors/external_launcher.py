"""This process as one rank of an engine started by ``torchrun``, with data parallelism.

``WORLD_SIZE`` may be any multiple of ``tensor_parallel_size``: consecutive groups of TP ranks
each form one engine (vLLM's layout, the groups TRL builds with ``new_subgroups_by_enumeration``)::

    WORLD_SIZE=8, tensor_parallel_size=2      engine (data_parallel_rank)   global ranks
    ────────────────────────────────────      ───────────────────────────   ────────────
                                              0                             0, 1
                                              1                             2, 3
                                              2                             4, 5
                                              3                             6, 7

Every rank of one engine runs the same engine loop in lockstep (scheduling and sampling are
deterministic), so each rank's in-process worker sees the same commands in the same order. Its
collectives (the layers' all-reduces, the KV sizing MIN) run on its own TP subgroup only, and
sleep, wake and refits touch only its own memory: no engine ever waits on another. Each rank
joins only its own subgroup (a group-local barrier), so engines start independently too.

Seeds follow vLLM's convention: an engine uses ``seed`` as given, the same on each of its
ranks (checked here: ranks that disagree would sample different tokens), and replicas differ
only when the caller gives them different seeds (TRL: ``seed=process_index // tp_size``).
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dormant.core.config import EngineConfig
from dormant.core.errors import UnsupportedOptionError
from dormant.distributed.communicator import NCCL_OWNER, is_nccl
from dormant.distributed.parallel_state import (
    DistributedTPGroup,
    SingleRankGroup,
    TPGroup,
    get_tp_group,
    init_tp_group,
    reset_tp_group,
)
from dormant.executors.uniproc import UniprocExecutor
from dormant.worker.worker import create_worker

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# This process's TP subgroups by their ranks, with the world group they were made in: one per
# ranks for the life of that world group (the process group registry is torch's, global too).
_subgroups: dict[tuple[int, ...], tuple[Any, Any]] = {}
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE")


def tp_group_ranks(world_size: int, tensor_parallel_size: int) -> list[list[int]]:
    """The global ranks of each engine: consecutive groups of ``tensor_parallel_size``."""
    tp = tensor_parallel_size
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


class ExternalLauncherExecutor(UniprocExecutor):
    """Hosts this process's rank of its engine; ``tp_ranks`` are the engine's global ranks."""

    def __init__(
        self,
        config: EngineConfig,
        group: TPGroup,
        tp_ranks: list[int],
        data_parallel_rank: int,
        data_parallel_size: int,
        local_rank: int,
    ) -> None:
        self.tp_group = group
        self.tp_ranks = tp_ranks
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        super().__init__(config, create_worker(config, group.rank, group.world_size, local_rank))

    def shutdown(self) -> None:
        super().shutdown()
        group, self.tp_group = self.tp_group, SingleRankGroup()  # a second call leaves nothing
        _leave(group)


def external_launcher_executor(config: EngineConfig) -> ExternalLauncherExecutor:
    """Joins this rank's engine (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` from ``torchrun``),
    installs its TP group and hosts this process's rank of it."""
    missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise UnsupportedOptionError(
            f"distributed_executor_backend='external_launcher' needs torchrun's {missing} in "
            "the environment: start every rank with torchrun (or set RANK, WORLD_SIZE, "
            "LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself)"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp = config.tensor_parallel_size
    if world_size % tp:
        raise UnsupportedOptionError(
            f"torchrun started {world_size} processes, which is not a multiple of "
            f"tensor_parallel_size={tp}: each engine takes {tp} consecutive ranks, so start "
            f"a multiple of {tp} processes"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    tp_ranks = tp_group_ranks(world_size, tp)[rank // tp]
    group = _join_tp_group(tp_ranks, rank, world_size, on_gpu, local_rank)
    try:
        free_before = torch.cuda.mem_get_info()[0] if on_gpu else 0
        _check_same_config(config, group, tp_ranks, on_gpu)  # its collective makes the NCCL comm
        made = free_before - torch.cuda.mem_get_info()[0] if on_gpu else None
        init_tp_group(group)
        executor = ExternalLauncherExecutor(
            config, group, tp_ranks, rank // tp, world_size // tp, local_rank
        )
        if is_nccl(group):  # made before the worker's manager started: measured here
            executor.worker.mm.residual.carve(NCCL_OWNER, made)
        return executor
    except BaseException:
        _leave(group)
        raise


def _join_tp_group(
    tp_ranks: list[int], rank: int, world_size: int, on_gpu: bool, local_rank: int
) -> TPGroup:
    """This engine's TP group: none at TP=1, torch's world group when the engine is the whole
    world, else a subgroup of ``tp_ranks`` that only they join."""
    if len(tp_ranks) == 1:
        return SingleRankGroup()
    if on_gpu:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    if len(tp_ranks) == dist.get_world_size():
        return DistributedTPGroup()
    world, subgroup = _subgroups.get(tuple(tp_ranks), (None, None))
    if subgroup is None or world is not dist.group.WORLD:
        subgroup = dist.new_group(
            tp_ranks, timeout=COLLECTIVE_TIMEOUT, use_local_synchronization=True
        )
        _subgroups[tuple(tp_ranks)] = (dist.group.WORLD, subgroup)
    return DistributedTPGroup(subgroup)


def _leave(group: TPGroup) -> None:
    """Uninstalls ``group``. Its process group stays, as torch's world group does: a later
    engine on the same ranks reuses it (destroying it and making it again would reuse its name,
    and the new group's rendezvous could read the old one's keys)."""
    if get_tp_group() is group:
        reset_tp_group()


def _check_same_config(
    config: EngineConfig, group: TPGroup, tp_ranks: list[int], on_gpu: bool
) -> None:
    """Raises on every rank of the engine if its ranks were given different seeds or other
    options: ranks that differ would schedule or sample differently and hang or diverge."""
    if group.world_size == 1:
        return
    device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"
    digest = hashlib.sha256(repr(config).encode()).digest()
    fingerprint = int.from_bytes(digest[:7], "little")  # fits an int64
    mine = torch.tensor([[config.seed, fingerprint]], dtype=torch.int64, device=device)
    seeds, fingerprints = group.all_gather(mine, dim=0).cpu().T.tolist()
    if len(set(seeds)) > 1:
        raise UnsupportedOptionError(
            f"the ranks {tp_ranks} of one engine were given the seeds {seeds}: every rank of "
            "an engine must sample the same tokens, so give them one seed (TRL gives "
            "seed=rank // tensor_parallel_size)"
        )
    if len(set(fingerprints)) > 1:
        raise UnsupportedOptionError(
            f"the ranks {tp_ranks} of one engine were given different options: give every "
            "rank of an engine the same LLM(...) arguments"
        )
