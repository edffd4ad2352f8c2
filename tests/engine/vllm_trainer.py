"""A trainer process that pushes weights with vLLM's weight-transfer helpers, as
``install_as_vllm()`` provides them (``nccl_common.trainer_init``, ``packed_tensor.
packed_nccl_broadcast_producer``, and the older ``NCCLWeightTransferEngine`` statics), for the
engine's and the server's weight-transfer tests."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from dormant.executors.multiproc import free_port
from tests.engine.conftest import hf_state_dict

SMALL_BUFFER = 4096  # bytes: the tiny model's tensors pack into several chunks


def run_trainer(port: int, sends: Sequence[tuple[int, str]], conn: Connection) -> None:
    """Rank 0: joins, then for each (seed, "packed" | "one by one") sends the state dict's
    metadata, waits for "go" and broadcasts it; exits on "done"."""
    import dormant

    dormant.install_as_vllm()
    from vllm.distributed.weight_transfer.nccl_common import trainer_init
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerSendWeightsArgs,
        NCCLWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    group = trainer_init({"master_address": "127.0.0.1", "master_port": port, "world_size": 2})
    conn.send("joined")
    for seed, how in sends:
        weights = list(hf_state_dict(seed).items())
        conn.send([(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in weights])
        assert conn.recv() == "go"
        if how == "packed":
            packed_nccl_broadcast_producer(
                iter(weights), group, 0, lambda item: item[1], buffer_size_bytes=SMALL_BUFFER
            )
        else:
            args = NCCLTrainerSendWeightsArgs(group=group, packed=False)
            NCCLWeightTransferEngine.trainer_send_weights(iter(weights), args)
    assert conn.recv() == "done"


def start_trainer(sends: Sequence[tuple[int, str]]) -> tuple[int, Connection, Any]:
    """The trainer in a spawned process: (its port, our end of its pipe, the process)."""
    context = mp.get_context("spawn")
    port = free_port()
    parent, child = context.Pipe()
    process = context.Process(target=run_trainer, args=(port, sends, child), daemon=True)
    process.start()
    return port, parent, process


def init_info(port: int, **extra: Any) -> dict[str, Any]:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, **extra}  # fmt: skip


def update_info(metadata: list[Any], **extra: Any) -> dict[str, Any]:
    names, dtypes, shapes = (list(column) for column in zip(*metadata, strict=True))
    return {"names": names, "dtype_names": dtypes, "shapes": shapes, **extra}
