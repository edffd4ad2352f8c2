"""The receiver's own held storages on the GPU (``worker/ipc_handles.py``): for every way a
trainer sends CUDA IPC buckets (``benchmarks/refit.py``'s sender: a new buffer per bucket, one
reused buffer, two halves of one buffer pipelined, its own tensors), two refits write exactly the
sent weights, every share's ref-counter is released (the trainer can free all it sent once the
engine ended the refit: torch's producer frees a shared block only when its counters drop), and
a held handle's counters go through the counter file mapped once per refit, not torch's release.
"""

from __future__ import annotations

import math
from multiprocessing import get_context

import pytest
import torch

from benchmarks.refit import TINY, build, checksum, ipc_case, sender_main
from dormant.models import ModelConfig
from dormant.worker.ipc_receiver import IpcReceiver
from dormant.worker.ipc_weights import FLATTENED_BUCKET, iter_buckets

pytestmark = pytest.mark.gpu
BUCKET_BYTES = 64 << 10
REFITS = 2


@pytest.mark.parametrize("mode", ["new", "reuse", "pipelined", "direct"])
def test_every_share_is_released_and_the_weights_arrive(mode: str) -> None:
    model = build(ModelConfig.from_dict(TINY), torch.device("cuda"))
    shapes = {n: tuple(s) for n, s in model.expected_weight_shapes().items()}
    on_meta = [(n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in shapes.items()]
    num_buckets = len(list(iter_buckets(on_meta, BUCKET_BYTES)))  # as the sender groups them
    assert num_buckets > 3
    context = get_context("spawn")
    conn, child = context.Pipe()
    sender = context.Process(
        target=sender_main, args=(child, shapes, "cuda", BUCKET_BYTES, 11, mode)
    )
    sender.start()
    try:
        sent = conn.recv()
        receiver = IpcReceiver()
        load_format = None if mode == "direct" else FLATTENED_BUCKET
        for _ in range(REFITS):
            ipc_case(receiver, model, conn, load_format, "run")  # ends with release()
            assert receiver.handles.num_held == 0
        received = checksum([p.detach() for p in model.parameters()])
        assert math.isclose(received, sent, rel_tol=1e-9)
        handles, counters = receiver.handles, receiver.handles.counters
        if mode in ("reuse", "pipelined"):  # one allocation: opened once per refit
            assert handles.num_opened == REFITS
            assert handles.num_reused == REFITS * (num_buckets - 1)
            assert 1 <= counters.num_mapped <= REFITS  # the file mapped, not torch's release
        elif mode == "new":
            assert handles.num_opened == REFITS * num_buckets and handles.num_reused == 0
        assert counters.num_released == handles.num_reused and counters.num_open == 0
        conn.send("free")
        assert conn.recv() == 0  # the trainer freed everything it sent
        conn.send("stop")
    finally:
        sender.join(timeout=60)
        model.memory.close()  # frees the device's manager slot for the next test
    torch.cuda.empty_cache()
