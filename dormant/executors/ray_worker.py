"""One rank of the engine inside a Ray actor (``RayExecutor`` makes it a remote class).

It speaks the multi-process executor's protocol: a typed command in, ``("ok", result)`` or
``("error", error)`` out, so a worker's typed errors reach the caller as themselves and a Ray
error means only one thing: the actor is gone.

GPUs are handled as vLLM's Ray workers handle them: Ray does not narrow the actor's
``CUDA_VISIBLE_DEVICES`` (the executor sets ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``), so a
worker sees its node's GPUs under the node's own indices and uses the one Ray assigned it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.executors.worker_process import init_distributed, portable
from dormant.worker.worker import Worker, create_worker

Reply = tuple[str, Any]


class RayWorker:
    def __init__(self, config: EngineConfig, rank: int, world_size: int, on_gpu: bool) -> None:
        self.config, self.rank, self.world_size, self.on_gpu = config, rank, world_size, on_gpu
        self.worker: Worker | None = None

    def address(self) -> tuple[str, int, int]:
        """(this node's IP, a free port on it, this process's pid)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, os.getpid()

    def start(self, init_method: str) -> Reply:
        """Joins the TP group (NCCL on GPUs, gloo on CPUs) and builds the worker."""
        try:
            local_rank = _assigned_gpu_index() if self.on_gpu else None
            subgroup = self.config.comm_sleep == "recreate"
            init_distributed(
                self.rank, self.world_size, init_method, self.on_gpu, local_rank, subgroup
            )
            self.worker = create_worker(self.config, self.rank, self.world_size, local_rank)
        except BaseException as error:
            return "error", portable(error)
        return "ok", os.getpid()

    def handle(self, message: tuple[Command, tuple[Any, ...], dict[str, Any]]) -> Reply:
        command, args, kwargs = message
        try:
            if self.worker is None:
                raise RuntimeError("the worker was not started")
            return "ok", self.worker.handle(command, *args, **kwargs)
        except BaseException as error:
            return "error", portable(error)

    def stop(self) -> None:
        """Releases the worker's memory and leaves the TP group; the executor kills the actor
        afterwards."""
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _assigned_gpu_index() -> int:
    """The torch index of the GPU Ray assigned this actor, among the GPUs it can see."""
    import ray

    ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if not ids:
        raise RuntimeError("Ray assigned this worker no GPU; its bundle needs a GPU")
    gpu = str(ids[0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if gpu not in order:
        raise RuntimeError(
            f"Ray assigned GPU {gpu}, which this process cannot see (CUDA_VISIBLE_DEVICES="
            f"{visible!r}, {torch.cuda.device_count()} devices)"
        )
    return order.index(gpu)
