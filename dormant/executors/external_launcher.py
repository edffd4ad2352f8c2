"""This process as one rank of an engine started by ``torchrun``.

Every rank runs the same engine loop in lockstep (scheduling and sampling are deterministic), so
each rank's in-process worker sees the same commands in the same order: the executor is an
in-process one whose worker is this process's rank.
"""

from __future__ import annotations

import os

import torch

from dormant.core.config import EngineConfig
from dormant.executors.uniproc import UniprocExecutor
from dormant.executors.worker_process import init_distributed
from dormant.worker.worker import create_worker


def external_launcher_executor(config: EngineConfig) -> UniprocExecutor:
    """Joins the ``torchrun`` group (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and hosts this
    process's rank."""
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != config.tensor_parallel_size:
        raise ValueError(
            f"torchrun started {world_size} processes but tensor_parallel_size is "
            f"{config.tensor_parallel_size}"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    init_distributed(int(os.environ["RANK"]), world_size, "env://", on_gpu, local_rank)
    rank = int(os.environ["RANK"])
    return UniprocExecutor(config, create_worker(config, rank, world_size, local_rank))
