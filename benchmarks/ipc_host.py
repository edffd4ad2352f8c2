"""The IPC receiver's host work per flattened bucket, on the CPU: what ``IpcReceiver``'s
``update_weights_from_tensor`` spends around the copy (issue 13).

The payloads are pickled exactly as a trainer's CUDA buckets are (``rebuild_cuda_tensor`` and its
15 arguments, the metadata as ``FlattenedTensorMetadata``), but a stand-in driver maps each
"handle" to a CPU buffer when ``IpcHandles`` opens it; the sender reuses one buffer (verl's way),
so after the first bucket of a refit every rebuild finds it held, releases the share's counter in
a real ref-counter file and waits on the (stand-in, no-op) event. The model has the 8B-like
model's names and its buckets the same tensors as 512 MiB buckets of the real shapes
(``--bucket-mib``), but small dimensions: a copy is then almost only its dispatch, as an
enqueue on the GPU is. Every refit sends the same layouts; the first refit builds the plans and
is not timed.

Prints one JSON line per stage (median and mean microseconds per bucket over every timed bucket):
``read`` (``PayloadSkeletons.read``: rebuilding the tensor and finding the bucket's layout, the
metadata unpickled only on a bucket's first read), ``plan`` (CopyPlans.get), ``copy`` (running
the plan's steps), ``end payload``, and ``call`` (the whole
``update_weights_from_tensor``, timed separately), plus the thread CPU time per call; then one
rebuild of a held storage by torch's ``rebuild_cuda_tensor`` and by ``IpcHandles`` (per call,
``held_rebuild``). The values written are checked against ``load_weights`` of the same tensors,
and the sender's counters: ``shares_held`` must equal ``handles_opened``.

    python benchmarks/ipc_host.py [--refits 20] [--bucket-mib 512] [--out host.jsonl]
"""

from __future__ import annotations

import argparse
import io
import mmap
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.multiprocessing import reductions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder
from benchmarks.decode import QWEN3_8B_LIKE
from dormant.memory import MemoryManager
from dormant.models import CausalLM, ModelConfig, build_model
from dormant.worker.ipc_counters import FILE_BYTES, HEADER_BYTES, REF_COUNTER_SLOTS, RefCounterFiles
from dormant.worker.ipc_handles import IpcHandles
from dormant.worker.ipc_receiver import IpcReceiver
from dormant.worker.ipc_weights import FLATTENED_BUCKET, pack_flattened_bucket
from dormant.worker.refit_record import RefitRecord

# The 8B-like model's layers and names, with small dimensions (every tensor a multiple of the
# pool's 256-byte alignment, as the real shapes are: a bucket in model order is then one copy),
# as small as that allows, so that the copies (real on the CPU) disturb the caches little.
SMALL = {
    **QWEN3_8B_LIKE, "vocab_size": 128, "hidden_size": 128, "intermediate_size": 128,
    "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 128,
    "torch_dtype": "bfloat16",
}  # fmt: skip
STAGES = ("read", "plan", "copy", "end payload")
HANDLE = b"sender-buffer"


class StandInDriver:
    """Maps a handle to its CPU buffer as a new storage (``open_storage`` stands in for torch's
    ``_new_shared_cuda``); the sender's ref-counter file is a real one, laid out as torch's, in
    /dev/shm (where torch's are), one slot per share as ``reduce_tensor`` takes them."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = np.zeros(nbytes, dtype=np.uint8)
        self.root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.counter_name = b"/torch_%d_ipc_host_0" % os.getpid()
        self.path = os.path.join(self.root, self.counter_name[1:].decode())
        with open(self.path, "wb") as file:
            file.write(bytes(FILE_BYTES))
        self.slots = np.memmap(self.path, np.int64, "r+", HEADER_BYTES, (REF_COUNTER_SLOTS,))
        self.num_shared = 0

    def share(self) -> int:
        slot = self.num_shared % REF_COUNTER_SLOTS
        self.slots[slot] = 1
        self.num_shared += 1
        return slot

    def open_storage(self, *args: Any) -> torch.UntypedStorage:
        return torch.from_numpy(self.buffer).untyped_storage()

    def handles(self) -> IpcHandles:
        return IpcHandles(self.open_storage, RefCounterFiles(self.root), lambda d, e: None)

    def close(self) -> None:
        os.unlink(self.path)


class SharedBuffer:
    """Pickles as a trainer's CUDA tensor does: ``rebuild_cuda_tensor`` and its 15 arguments."""

    def __init__(self, tensor: Tensor, driver: StandInDriver) -> None:
        self.tensor, self.counter, self.slot = tensor, driver.counter_name, driver.share()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reductions.rebuild_cuda_tensor, rebuild_args(self.tensor, self.counter, self.slot)


def rebuild_args(t: Tensor, counter: bytes, slot: int, storage_cls: Any = torch.UntypedStorage):
    return (
        Tensor, t.shape, t.stride(), t.storage_offset(), storage_cls, t.dtype, 0, HANDLE,
        t.untyped_storage().nbytes(), 0, False, counter, slot, b"event-handle" * 5, True,
    )  # fmt: skip


def serialize(driver: StandInDriver, bucket: list[tuple[str, Tensor]]) -> bytes:
    payload = pack_flattened_bucket(torch.from_numpy(driver.buffer), bucket)
    stream = io.BytesIO()
    shared = SharedBuffer(payload["flattened_tensor"], driver)
    pickle.Pickler(stream).dump({"flattened_tensor": shared, "metadata": payload["metadata"]})
    return stream.getvalue()


def pooled_model(config: ModelConfig) -> CausalLM:
    """As the worker builds it: on meta, adopted into a host pool (parameters back to back)."""
    with torch.device("meta"):
        model = build_model(config)
    MemoryManager("host").adopt(model)
    model.init_buffers()
    model.reset_kv_scales()
    model.init_random_weights(0)
    model.weight_observer = RefitRecord(model.expected_weight_shapes())  # the worker's record
    return model


def bucket_names(bucket_bytes: int) -> list[list[str]]:
    """The names of each bucket of the real 8B-like shapes (bf16), as ``iter_buckets`` groups
    them: consecutive, at most ``bucket_bytes`` each, a larger tensor alone."""
    with torch.device("meta"):
        shapes = build_model(ModelConfig.from_dict(QWEN3_8B_LIKE)).expected_weight_shapes()
    buckets: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = shape.numel() * 2
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def new_weights(model: CausalLM, seed: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator).bfloat16()
        for name, shape in model.expected_weight_shapes().items()
    }


def verify(model: CausalLM, weights: dict[str, Tensor]) -> bool:
    reference = pooled_model(model.config)
    reference.load_weights(list(weights.items()))
    expected = dict(reference.named_parameters())
    return all(torch.equal(p, expected[n]) for n, p in model.named_parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refits", type=int, default=20)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    recorder = Recorder(args.out)
    model = pooled_model(ModelConfig.from_dict(SMALL))
    groups = bucket_names(args.bucket_mib * MiB)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    driver = StandInDriver(2 * weight_bytes + (1 << 20))
    receiver = IpcReceiver(driver.handles())
    stages: dict[str, list[float]] = {stage: [] for stage in (*STAGES, "call", "call cpu")}
    weights: dict[str, Tensor] = {}
    for refit in range(args.refits + 1):
        weights = new_weights(model, refit)
        for names in groups:
            entry = serialize(driver, [(name, weights[name]) for name in names])
            if refit % 2:  # the call as the worker makes it, whole
                t0, c0 = time.perf_counter(), time.thread_time()
                receiver.update_weights_from_tensor(model, [entry], load_format=FLATTENED_BUCKET)
                t1, c1 = time.perf_counter(), time.thread_time()
                if refit:
                    stages["call"].append(t1 - t0)
                    stages["call cpu"].append(c1 - c0)
                continue
            t0 = time.perf_counter()  # its stages, as ipc_stages.py times them on the GPU
            flat_bytes, items = receiver.skeletons.read(entry, receiver.handles.rebuild_cuda_tensor)
            t1 = time.perf_counter()
            plan = receiver.plans.get(model, items)
            t2 = time.perf_counter()
            with torch.no_grad():
                for step in plan.steps:
                    step.run(flat_bytes)
            t3 = time.perf_counter()
            del flat_bytes
            receiver.handles.end_payload()
            t4 = time.perf_counter()
            if refit:
                seconds = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
                for stage, value in zip(STAGES, seconds, strict=True):
                    stages[stage].append(value)
        receiver.release()
    handles = receiver.handles
    recorder.emit(
        case="ipc host setup", torch=torch.__version__, buckets_per_refit=len(groups),
        tensors_per_bucket=statistics.mean(len(g) for g in groups), refits=args.refits,
        plans_built=receiver.plans.num_built, verified=verify(model, weights),
        copies_per_bucket=statistics.mean(p.num_copies for p in receiver.plans.of(model)),
        handles_opened=handles.num_opened, handles_reused=handles.num_reused,
        skeleton_hits=receiver.skeletons.num_hits, skeleton_misses=receiver.skeletons.num_misses,
        counter_files_mapped=handles.counters.num_mapped,
        counters_released=handles.counters.num_released,
        # every share's counter released once, but the opened ones' (their deleter's, on a GPU)
        shares_held=int(driver.slots[: driver.num_shared].sum()),
    )  # fmt: skip
    for stage, values in (*stages.items(), *held_rebuild(driver).items()):
        recorder.emit(
            case="ipc host stage", stage=stage, buckets=len(values),
            median_us=statistics.median(values) * 1e6, mean_us=statistics.mean(values) * 1e6,
        )  # fmt: skip
    driver.close()


class TorchStorage(torch.UntypedStorage):
    """The storage class torch's own held-storage path is given, its C++ counter release as
    ``_release_ipc_counter`` runs it per call: map the file, decrement the slot, unmap."""

    root = ""

    @classmethod
    def _release_ipc_counter(cls, name: bytes, slot: int, device: Any = None) -> None:
        fd = os.open(os.path.join(cls.root, name[1:].decode()), os.O_RDWR)
        try:
            os.fstat(fd)
            with mmap.mmap(fd, FILE_BYTES) as file:
                view = memoryview(file)[HEADER_BYTES:].cast("q")
                view[slot] -= 1
                view.release()
        finally:
            os.close(fd)


def held_rebuild(driver: StandInDriver, calls: int = 3000) -> dict[str, list[float]]:
    """One rebuild of a held storage (a reused buffer's every bucket but the first), torch's
    ``rebuild_cuda_tensor`` (its cache, ``TypedStorage``, ``_rebuild_tensor``, the counter
    release above) against ``IpcHandles``' (its map, a view, the counter in the mapped file);
    the event wait is not in either (a driver call on the GPU)."""
    tensor = torch.from_numpy(driver.buffer)[: 1 << 20]
    TorchStorage.root = driver.root
    key = (HANDLE, 0)
    storage = tensor.untyped_storage()
    reductions.shared_cache[key] = reductions.StorageWeakRef(storage)
    handles = driver.handles()
    handles.rebuild_cuda_tensor(*rebuild_args(tensor, driver.counter_name, driver.share()))
    times: dict[str, list[float]] = {"held rebuild, torch's": [], "held rebuild, ours": []}
    for _ in range(calls):
        for stage, rebuild, storage_cls in (
            ("held rebuild, torch's", reductions.rebuild_cuda_tensor, TorchStorage),
            ("held rebuild, ours", handles.rebuild_cuda_tensor, torch.UntypedStorage),
        ):
            args = rebuild_args(tensor, driver.counter_name, driver.share(), storage_cls)
            t0 = time.perf_counter()
            rebuild(*args)
            times[stage].append(time.perf_counter() - t0)
    del reductions.shared_cache[key]
    handles.release()
    return times


if __name__ == "__main__":
    torch.set_num_threads(1)  # the copies on one thread, as the host path runs
    main()
