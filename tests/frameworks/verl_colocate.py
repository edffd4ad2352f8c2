"""verl's colocated refit, both ends, written for dormant: the worker extension verl passes as
``worker_extension_cls`` (``vLLMColocateWorkerExtension``) and the trainer side that fills its
IPC bucket (``ServerAdapter.update_weights``). Only the calls and the wire protocol are verl's
(volcengine/verl@b178a3cd, ``verl/workers/rollout/vllm_rollout/utils.py`` and
``vllm_rollout.py``); the code is this project's:

    trainer (ServerAdapter.update_weights)          engine worker (update_weights_from_ipc)
    ──────────────────────────────────────────────  ──────────────────────────────────────────
    buffer = uint8[bucket_bytes]; handle of it      connect to the trainer's socket
    send(handle)                               ──▶  buffer = rebuild_ipc(handle, device.index)
                                               ◀──  ack
    per bucket: copy tensors in at offsets,
    send({"bucket_meta", "is_last"})           ──▶  clone each view out of the buffer
                                               ◀──  ack; model_runner.model.load_weights(...)

verl speaks this over ZMQ REQ/REP on ``ipc:///tmp/rl-colocate-zmq-{device_uuid}.sock``; here
it runs over ``multiprocessing.connection`` on a Unix socket (same roles: the trainer binds,
the worker connects), so the tests need no pyzmq. On the GPU the handle is
``torch.multiprocessing.reductions.reduce_tensor(buffer)``, as verl sends it; on the CPU, where
the trainer is a thread of the engine's process, it is a lookup of the same buffer in this
process (``rebuild_ipc`` calls it the same way).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch
from torch import Tensor

SOCKET_ENV = "DORMANT_TEST_VERL_SOCKET"  # the Unix socket both ends meet on
EXTENSION = "tests.frameworks.verl_colocate.VerlColocateExtension"
_IN_PROCESS_BUFFERS: dict[int, Tensor] = {}


class VerlColocateExtension:
    """verl's calls from inside a worker: ``self.model_runner.model`` (its ``compute_logits``
    and ``load_weights``) and ``self.device``."""

    model_runner: Any
    device: torch.device

    def monkey_patch_model(self, vocab_size: int) -> None:
        """verl utils.py L85-97, L152-154: ids past the tokenizer's vocabulary never sampled."""
        model = self.model_runner.model
        original = model.compute_logits

        def compute_logits(*args: Any, **kwargs: Any) -> Tensor:
            logits = original(*args, **kwargs)
            logits[..., vocab_size:] = float("-inf")
            return logits

        model.compute_logits = compute_logits

    def update_weights_from_ipc(
        self, peft_config: dict[str, Any] | None = None, base_sync_done: bool = False
    ) -> None:
        """verl utils.py L158-202: receive the bucket buffer, then each bucket's tensors."""
        if peft_config:
            raise NotImplementedError("LoRA refits are not part of this test")
        with _connect(os.environ[SOCKET_ENV]) as conn:
            buffer = rebuild_ipc(conn.recv(), self.device.index)
            assert buffer.dtype == torch.uint8
            conn.send(b"")
            while True:
                metadata = conn.recv()
                weights = []
                for name, meta in metadata["bucket_meta"].items():
                    shape, dtype, offset = meta["shape"], meta["dtype"], meta["offset"]
                    size = dtype.itemsize * shape.numel()
                    view = buffer[offset : offset + size].view(dtype=dtype).view(shape)
                    weights.append((name, view.clone()))  # the sender reuses the buffer
                _synchronize(self.device)
                conn.send(b"")
                self.model_runner.model.load_weights(weights)
                del weights
                if metadata["is_last"]:
                    break
            del buffer


def rebuild_ipc(handle: tuple[Callable[..., Tensor], tuple[Any, ...]], device_id: int | None):
    """verl utils.py L101-109: the handle's rebuild call, with the receiver's device index."""
    func, args = handle
    list_args = list(args)
    if device_id is not None:  # rebuild_cuda_tensor's argument 6 is the device
        list_args[6] = device_id
    return func(*list_args)


def send_weights_in_buckets(
    address: str,
    weights: Iterable[tuple[str, Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """verl vllm_rollout.py L155-205, the trainer's side: one reused ``bucket_bytes`` buffer,
    each tensor cast to the rollout dtype and copied in; returns the number of buckets sent."""
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    with Listener(address, family="AF_UNIX") as listener, listener.accept() as conn:
        conn.send(_handle_of(buffer))
        conn.recv()
        offset, bucket_meta, num_buckets = 0, {}, 0
        for name, tensor in weights:
            weight = tensor.to(dtype, non_blocking=True)
            if offset + weight.nbytes > bucket_bytes:
                _synchronize(device)
                conn.send({"bucket_meta": bucket_meta, "is_last": False})
                conn.recv()
                bucket_meta, offset, num_buckets = {}, 0, num_buckets + 1
            assert offset + weight.nbytes <= bucket_bytes, f"{name} does not fit a bucket"
            bucket_meta[name] = {
                "name": name, "shape": weight.shape, "dtype": weight.dtype, "offset": offset
            }  # fmt: skip
            flat = weight.reshape(-1).view(torch.uint8)
            buffer[offset : offset + weight.nbytes].copy_(flat, non_blocking=True)
            offset += weight.nbytes
        _synchronize(device)
        conn.send({"bucket_meta": bucket_meta, "is_last": True})
        conn.recv()
    _IN_PROCESS_BUFFERS.pop(id(buffer), None)
    return num_buckets + 1


def sender_process(address: str, seed: int, bucket_bytes: int, result: Connection) -> None:
    """The trainer as its own process (the GPU test): CUDA IPC handles, as verl sends them."""
    from tests.engine.conftest import hf_state_dict

    weights = [(n, t.to("cuda")) for n, t in hf_state_dict(seed).items()]
    num_buckets = send_weights_in_buckets(
        address, weights, bucket_bytes, torch.float32, torch.device("cuda")
    )
    result.send(num_buckets)


def _handle_of(buffer: Tensor) -> tuple[Callable[..., Tensor], tuple[Any, ...]]:
    if buffer.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(buffer)
    _IN_PROCESS_BUFFERS[id(buffer)] = buffer
    return _in_process_buffer, (id(buffer),)


def _in_process_buffer(key: int) -> Tensor:
    return _IN_PROCESS_BUFFERS[key]


def _connect(address: str, timeout_s: float = 60.0) -> Connection:
    """The worker connects once the trainer listens (ZMQ's connect waits for the bind)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, family="AF_UNIX")
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
