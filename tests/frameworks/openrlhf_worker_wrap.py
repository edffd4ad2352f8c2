"""A worker extension shaped like OpenRLHF's ``WorkerWrap``
(``openrlhf/trainer/ray/vllm_worker_wrap.py`` at OpenRLHF/OpenRLHF@3c3be62), importable by
qualified name as ``worker_extension_cls``. Our own code: it makes the calls OpenRLHF's makes
on the worker (``self.device``, ``self.model_config.dtype``,
``self.model_runner.model.load_weights(weights=[(name, weight)])``), with two stand-ins:

- the weight-update group is dormant's (``create_update_group``: a TCP rendezvous and a torch
  process group, gloo on CPUs) where OpenRLHF builds vLLM's ``StatelessProcessGroup`` plus a
  ``PyNcclCommunicator`` (NCCL only; dormant provides neither);
- the rank is the worker's ``self.rank`` where OpenRLHF reads ``torch.distributed.get_rank()``
  (dormant's TP=1 engine runs without a torch.distributed default group).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dormant.worker.update_group import create_update_group


def physical_gpu_id(device: torch.device | str | int | None = None) -> str:
    """The GPU's UUID (what OpenRLHF's ``get_physical_gpu_id`` keys IPC handles by)."""
    return str(torch.cuda.get_device_properties(device).uuid)


class WorkerWrap:
    device: torch.device
    rank: int
    model_config: Any
    model_runner: Any

    def init_process_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        use_ray: bool = False,
    ) -> None:
        """vllm_worker_wrap.py L2-30: joins the trainer's group as ``rank + rank_offset``."""
        if use_ray:
            raise NotImplementedError("the test's extension has no ray.util.collective path")
        if not group_name:
            raise ValueError("group name must not be empty")
        rank = self.rank + rank_offset
        self._model_update_group = create_update_group(
            master_address, master_port, rank, world_size, group_name, backend
        )

    def update_weight(
        self, name: str, dtype: torch.dtype, shape: Any, empty_cache: bool = False
    ) -> None:
        """vllm_worker_wrap.py L32-50: receives rank 0's broadcast of one tensor and loads it."""
        if dtype != self.model_config.dtype:
            raise ValueError(f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}")
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(weight, src=0, group=self._model_update_group)
        self.model_runner.model.load_weights(weights=[(name, weight)])
        del weight

    def update_weight_cuda_ipc(
        self,
        name: str,
        dtype: torch.dtype,
        shape: Any,
        ipc_handles: dict[str, Any] | None = None,
        empty_cache: bool = False,
    ) -> None:
        """vllm_worker_wrap.py L52-70: rebuilds the trainer's tensor from its CUDA IPC handle
        (keyed by GPU UUID; argument 6 is the device index, rewritten to this process's) and
        loads it."""
        if dtype != self.model_config.dtype:
            raise ValueError(f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}")
        assert ipc_handles is not None
        func, args = ipc_handles[physical_gpu_id(self.device)]
        list_args = list(args)
        list_args[6] = self.device.index
        weight = func(*list_args)
        self.model_runner.model.load_weights(weights=[(name, weight)])
        torch.cuda.synchronize()
