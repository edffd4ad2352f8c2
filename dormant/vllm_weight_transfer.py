"""vLLM's weight-transfer API (``vllm.distributed.weight_transfer``): its request types, and the
trainer's side of its NCCL backend, which ``dormant.install_as_vllm()`` installs under vLLM's
names for trainers that push weights to a dormant engine or server (TRL's ``VLLMClient``).

The engine's side is ``LLM.init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights(request)`` / ``finish_weight_update`` (and the server's routes of the same
names). The group is dormant's weight-update group (``worker/group_rendezvous.py``): the trainer
is rank 0 and joins by ``master_address:master_port``; NCCL where the engine runs on GPUs, gloo
where it runs on the CPU (``"backend"`` in the init info says which, default by this process's
devices). vLLM's own trainer helpers (a ``StatelessProcessGroup`` with vLLM's pynccl) do not
join it: the trainer runs these, as it does when its script calls ``install_as_vllm()``.

Packed updates are vLLM's wire format: the tensors' bytes back to back in uint8 chunks, each
chunk ending with the tensor that takes it past ``packed_buffer_size_bytes``
(``packed_chunks``); both sides cut the same chunks from the same sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dormant.worker.group_broadcasts import from_rank0, packed_chunks, wait_for
from dormant.worker.group_rendezvous import DEFAULT_TIMEOUT_S, create_update_group

GROUP_NAME = "vllm_weight_transfer"
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2


@dataclass
class WeightTransferInitRequest:
    """vLLM's: what ``init_weight_transfer_engine`` takes (``init_info`` as a dict)."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """vLLM's: what ``update_weights`` takes (``update_info`` as a dict)."""

    update_info: dict[str, Any] = field(default_factory=dict)


class _Rendezvous:
    """Where vLLM's communicator keeps its ``StatelessProcessGroup``: TRL drops ``store`` and
    ``socket`` to close it."""

    def __init__(self, store: Any) -> None:
        self.store: Any = store
        self.socket: Any = None


class TrainerGroup:
    """The trainer's end of the group (vLLM returns a ``PyNcclCommunicator``): ``broadcast``
    sends one tensor from rank 0 to every engine rank."""

    def __init__(self, process_group: dist.ProcessGroup, timeout_s: float) -> None:
        self.process_group = process_group
        self.timeout_s = timeout_s
        self.group = _Rendezvous(store=process_group)

    def broadcast(self, tensor: Tensor, src: int = 0, stream: Any = None) -> None:
        if src != 0:
            raise ValueError(f"the trainer is rank 0 of the weight-transfer group; src={src}")
        wait_for(self.process_group.broadcast([tensor.contiguous()], from_rank0()), self.timeout_s)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def trainer_init(init_info: Mapping[str, Any] | Any) -> TrainerGroup:
    """vLLM's ``nccl_common.trainer_init``: joins the group as rank 0 (blocks until every
    engine rank joined: call it beside the engine's ``init_weight_transfer_engine``)."""
    info = init_info if isinstance(init_info, Mapping) else vars(init_info)
    backend = info.get("backend") or default_backend()
    timeout_s = float(info.get("timeout_s", DEFAULT_TIMEOUT_S))
    group = create_update_group(
        info["master_address"], int(info["master_port"]), 0, int(info["world_size"]),
        GROUP_NAME, backend, timeout_s,
    )  # fmt: skip
    return TrainerGroup(group, timeout_s)


def packed_nccl_broadcast_producer(
    iterator: Iterator[tuple[str, Tensor]],
    group: TrainerGroup,
    src: int,
    post_iter_func: Callable[[tuple[str, Tensor]], Tensor],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
) -> None:
    """vLLM's: broadcasts the tensors packed into uint8 chunks (``packed_chunks``)."""
    flat = (post_iter_func(item).contiguous().view(torch.uint8).view(-1) for item in iterator)
    for chunk in packed_chunks(flat, Tensor.numel, buffer_size_bytes):
        group.broadcast(torch.cat(chunk), src)


@dataclass
class NCCLTrainerSendWeightsArgs:
    """vLLM's (< 0.28) arguments of ``NCCLWeightTransferEngine.trainer_send_weights``."""

    group: Any
    src: int = 0
    post_iter_func: Callable[[tuple[str, Tensor]], Tensor] | None = None
    packed: bool = False
    stream: Any = None
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


class NCCLWeightTransferEngine:
    """vLLM's (< 0.28) static trainer helpers of its NCCL backend."""

    trainer_init = staticmethod(trainer_init)

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, Tensor]],
        trainer_args: Mapping[str, Any] | NCCLTrainerSendWeightsArgs,
    ) -> None:
        args = (
            NCCLTrainerSendWeightsArgs(**trainer_args)
            if isinstance(trainer_args, Mapping)
            else trainer_args
        )
        post = args.post_iter_func or (lambda item: item[1])
        if args.packed:
            packed_nccl_broadcast_producer(
                iterator, args.group, args.src, post, args.packed_buffer_size_bytes
            )
            return
        for item in iterator:
            args.group.broadcast(post(item), args.src)
