"""The loop of one worker process: typed commands in, results (or errors) out, until told to stop
or until the parent is gone.

A worker dies with its parent: ``PR_SET_PDEATHSIG`` asks the kernel to kill it the moment the
parent exits (even by SIGKILL), and the loop also checks its parent while idle, so no engine
process outlives the engine that started it.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.distributed.parallel_state import DistributedTPGroup, init_tp_group

_PR_SET_PDEATHSIG = 1
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class RemoteError(RuntimeError):
    """An error raised in a worker whose own type could not travel back as it was."""


def die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    on_gpu: bool,
    local_rank: int | None = None,
    subgroup: bool = False,
) -> None:
    """Joins the process group (NCCL on GPUs, gloo on CPUs) and installs it as the TP group,
    or, with ``subgroup``, a group of all its ranks made from it (one that can be destroyed and
    made again: ``comm_sleep="recreate"``). The process uses GPU ``local_rank`` (default:
    ``rank``, one host)."""
    if on_gpu:
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    group = dist.new_group(list(range(world_size))) if subgroup else None
    init_tp_group(DistributedTPGroup(group))


def worker_main(
    rank: int,
    world_size: int,
    config: EngineConfig,
    init_method: str,
    conn: Connection,
    parent_pid: int,
) -> None:
    from dormant.worker.worker import create_worker  # after the spawn: nothing imported twice

    die_with_parent()
    if os.getppid() != parent_pid:
        return
    on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    try:
        subgroup = config.comm_sleep == "recreate"
        init_distributed(rank, world_size, init_method, on_gpu, subgroup=subgroup)
        worker = create_worker(config, rank, world_size)
    except BaseException as error:
        conn.send(("error", portable(error)))
        return
    conn.send(("ok", os.getpid()))
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent_pid:  # the parent is gone: so are we
                break
            continue
        command, args, kwargs = conn.recv()
        try:
            result = worker.handle(command, *args, **kwargs)
            conn.send(("ok", result))
        except BaseException as error:
            conn.send(("error", portable(error)))
        if command is Command.SHUTDOWN:
            break
    dist.destroy_process_group()


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling as itself, else a RemoteError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        text = "".join(traceback.format_exception(error)).strip()
        return RemoteError(f"{type(error).__name__} in a worker: {error}\n{text}")
