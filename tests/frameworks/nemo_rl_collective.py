"""NeMo-RL's refit over a collective, both ends, written for dormant: the worker extension
NeMo-RL passes as ``worker_extension_cls`` (``VllmInternalWorkerExtension``) and the trainer
that broadcasts packed weights (``broadcast_weights_for_collective``). Only the calls and the
wire protocol are NeMo-RL's (NVIDIA-NeMo/RL@7ea279ab: ``nemo_rl/models/generation/vllm/
vllm_backend.py``, ``nemo_rl/utils/packed_tensor.py``,
``nemo_rl/models/policy/workers/dtensor_policy_worker.py``); the code is this project's.

The packed protocol (packed_tensor.py L39-256): both ends walk the same ``{name: (shape,
dtype)}`` in order and cut it into packs the same way (a pack closes once its bytes pass the
target size); rank 0 broadcasts each pack as one uint8 tensor, the tensors' bytes back to
back, and each engine rank splits it into its tensors and loads them.

NeMo-RL builds its group with its ``StatelessProcessGroup`` (a TCPStore and an NCCL
communicator); here it is ``dormant.worker.update_group.create_update_group`` (a TCP
rendezvous and a gloo or NCCL group), so the trainer can be a CPU process in CI.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dormant.worker.update_group import create_update_group

EXTENSION = "tests.frameworks.nemo_rl_collective.NemoRLWorkerExtension"
GROUP_NAME = "nemo_rl_refit"
PACKED_TENSOR_BYTES = 96 << 10  # NeMo-RL: 2% of device memory, at most 5 GB; tiny here
TIMEOUT_S = 60.0
StateDictInfo = dict[str, tuple[torch.Size, torch.dtype]]
logger = logging.getLogger(__name__)


class NemoRLWorkerExtension:
    """NeMo-RL's calls from inside a worker: ``self.model_runner.model.load_weights(weights=)``,
    ``self.device`` and the worker's rank."""

    model_runner: Any
    device: torch.device
    rank: int

    def report_device_id(self) -> str:
        """vllm_backend.py L287-291 (the CUDA device's UUID; the CPU has none)."""
        if self.device.type != "cuda":
            return "cpu"
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def init_collective(
        self, rank_prefix: int, ip: str, port: int, world_size: int, train_world_size: int
    ) -> None:
        """vllm_backend.py L228-251: the engine's ranks come after every trainer rank."""
        rank = train_world_size + rank_prefix + self.rank
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.model_update_group = create_update_group(
            ip, port, rank, world_size, GROUP_NAME, backend, TIMEOUT_S
        )

    def prepare_refit_info(self, state_dict_info: StateDictInfo) -> None:
        """vllm_backend.py L317-324."""
        self.state_dict_info = state_dict_info

    def update_weights_from_collective(self) -> bool:
        """vllm_backend.py L751-779: receive the packs, load each; False on any error (NeMo-RL
        logs it and the caller raises)."""
        assert getattr(self, "state_dict_info", None) is not None, (
            "state_dict_info is not prepared; call prepare_refit_info first"
        )
        try:
            packed_broadcast_consumer(
                iter(self.state_dict_info.items()),
                self.model_update_group,
                self.device,
                self._load_weights,
            )
        except Exception:
            logger.exception("update_weights_from_collective failed")
            return False
        return True

    def cleanup(self) -> None:
        """vllm_backend.py L1211-1216, and the group this extension made."""
        group = getattr(self, "model_update_group", None)
        if group is not None:
            dist.destroy_process_group(group)
            self.model_update_group = None

    def _load_weights(self, weights: list[tuple[str, Tensor]]) -> None:
        """vllm_backend.py L196-207, L574-594 for a model with no draft or FP8 weights."""
        self.model_runner.model.load_weights(weights=weights)


def packed_broadcast_consumer(
    iterator: Iterator[tuple[str, tuple[torch.Size, torch.dtype]]],
    group: dist.ProcessGroup,
    device: torch.device,
    post_unpack_func: Callable[[list[tuple[str, Tensor]]], None],
) -> None:
    """packed_tensor.py L129-256 (one buffer instead of two alternating streams)."""
    specs = (
        (name, math.prod(shape) * dtype.itemsize, (shape, dtype))
        for name, (shape, dtype) in iterator
    )
    for pack in _packs(specs):
        packed = torch.empty(sum(size for _, size, _ in pack), dtype=torch.uint8, device=device)
        _broadcast_from_rank0(group, packed)
        parts = packed.split_with_sizes([size for _, size, _ in pack])
        weights = []
        for (name, _, (shape, dtype)), part in zip(pack, parts, strict=True):
            if part.storage_offset() % dtype.itemsize:
                part = part.clone()  # an unaligned slice (L171-173)
            weights.append((name, part.view(dtype).reshape(tuple(shape))))
        post_unpack_func(weights)


def packed_broadcast_producer(
    iterator: Iterator[tuple[str, Tensor]],
    group: dist.ProcessGroup,
    post_iter_func: Callable[[tuple[str, Tensor]], Tensor],
) -> int:
    """packed_tensor.py L39-126, the trainer's side; returns the number of packs sent."""
    tensors = ((name, post_iter_func((name, t)).contiguous().reshape(-1).view(torch.uint8))
               for name, t in iterator)  # fmt: skip
    num_packs = 0
    for pack in _packs((name, flat.numel(), flat) for name, flat in tensors):
        _broadcast_from_rank0(group, torch.cat([flat for _, _, flat in pack]))
        num_packs += 1
    return num_packs


def _to_policy_dtype(item: tuple[str, Tensor]) -> Tensor:
    """dtensor_policy_worker.py L1923-1930: each tensor in the policy's dtype (float32 here)."""
    return item[1].to(torch.float32, non_blocking=True)


def _broadcast_from_rank0(group: dist.ProcessGroup, tensor: Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _packs(items: Iterator[tuple[str, int, Any]]) -> Iterator[list[tuple[str, int, Any]]]:
    """NeMo-RL's cut, the same on both ends: a pack closes once its bytes pass the target."""
    pack: list[tuple[str, int, Any]] = []
    num_bytes = 0
    for item in items:
        pack.append(item)
        num_bytes += item[1]
        if num_bytes > PACKED_TENSOR_BYTES:
            yield pack
            pack, num_bytes = [], 0
    if pack:
        yield pack


def trainer_main(port: int, world_size: int, seeds: list[int], conn: Connection) -> None:
    """The trainer (rank 0) in its own process: NeMo-RL's ``prepare_refit_info`` and
    ``init_collective`` (grpo.py L1577-1583), then one broadcast per seed when asked."""
    from tests.engine.conftest import hf_state_dict

    states = {seed: hf_state_dict(seed) for seed in seeds}
    first = states[seeds[0]]
    conn.send({name: (t.shape, t.dtype) for name, t in first.items()})
    group = create_update_group("127.0.0.1", port, 0, world_size, GROUP_NAME, "gloo", TIMEOUT_S)
    for seed in seeds:
        conn.recv()  # the engine is about to receive
        num_packs = packed_broadcast_producer(iter(states[seed].items()), group, _to_policy_dtype)
        conn.send(num_packs)
    conn.recv()  # the engine destroyed its end
    dist.destroy_process_group(group)
