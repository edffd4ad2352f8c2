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
the plan's steps), ``end payload``, and ``call`` (the whole ``update_weights_from_tensor``,
timed separately), plus the thread CPU time per call; ``llm call`` (and its CPU time): the same
buckets through a CPU engine's ``LLM.update_weights_from_tensor`` (one in-process rank, as a
one-GPU engine runs: the engine's refit and what it does after the command, the executor, the
worker, the refitter, the receiver; ``ipc_host_parts.engine_receiving_from``); then one rebuild
of a held storage by torch's ``rebuild_cuda_tensor`` and by ``IpcHandles`` (per call,
``held_rebuild``), and the same buckets as the receiver read them before (``torch path: ...``:
torch's rebuild on its cache, the whole pickle and its metadata read every bucket; its counter
release is torch's per-call map and unmap done in Python, ``ipc_host_parts.TorchStorage``). The
values written are checked against ``load_weights`` of the same tensors (the engine's too), and
the sender's counters: ``shares_held`` must equal ``handles_opened``.

    python benchmarks/ipc_host.py [--refits 20] [--bucket-mib 512] [--out host.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor
from torch.multiprocessing import reductions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder
from benchmarks.decode import QWEN3_8B_LIKE
from benchmarks.ipc_host_parts import (
    StandInDriver,
    engine_receiving_from,
    held_rebuild,
    hold_in_torchs_cache,
    serialize,
    torch_rebuild,
)
from dormant import LLM
from dormant.memory import MemoryManager
from dormant.models import CausalLM, ModelConfig, build_model
from dormant.worker.copy_plans import CopyPlans
from dormant.worker.ipc_payload import deserialize_payload
from dormant.worker.ipc_receiver import IpcReceiver
from dormant.worker.ipc_weights import FLATTENED_BUCKET, bucket_items
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
TORCH_PATH = ("rebuild", "items", "plan", "copy")  # torch_path's stages


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
    parts = (
        *engine_calls(recorder, groups, driver, args.refits).items(),
        *held_rebuild(driver).items(),
        *torch_path(model, groups, driver, args.refits).items(),
    )
    for stage, values in (*stages.items(), *parts):
        recorder.emit(
            case="ipc host stage", stage=stage, buckets=len(values),
            median_us=statistics.median(values) * 1e6, mean_us=statistics.mean(values) * 1e6,
        )  # fmt: skip
    driver.close()


def engine_calls(
    recorder: Recorder, groups: list[list[str]], driver: StandInDriver, refits: int
) -> dict[str, list[float]]:
    """The same buckets through a CPU engine's ``LLM.update_weights_from_tensor`` (the engine's
    refit, its executor, the worker's ``handle``, the refitter, the receiver, and whatever the
    engine does after the command); the first refit builds the plans and is not timed."""
    llm, receiver = engine_receiving_from(driver, ModelConfig.from_dict(SMALL))
    model = receiver_model(llm)
    stages: dict[str, list[float]] = {"llm call": [], "llm call cpu": []}
    weights: dict[str, Tensor] = {}
    for refit in range(refits + 1):
        weights = new_weights(model, refit)
        for names in groups:
            entry = serialize(driver, [(name, weights[name]) for name in names])
            t0, c0 = time.perf_counter(), time.thread_time()
            llm.update_weights_from_tensor([entry], load_format=FLATTENED_BUCKET)
            t1, c1 = time.perf_counter(), time.thread_time()
            if refit:
                stages["llm call"].append(t1 - t0)
                stages["llm call cpu"].append(c1 - c0)
        receiver.release()
    recorder.emit(
        case="ipc host engine", verified=verify(model, weights),
        stale_weights=len(llm.llm_engine.sleep_control.stale_weights),
        handles_opened=receiver.handles.num_opened, handles_reused=receiver.handles.num_reused,
    )  # fmt: skip
    llm.shutdown()
    return stages


def receiver_model(llm: LLM) -> CausalLM:
    return llm.llm_engine.executor.worker.model  # type: ignore[attr-defined]


def torch_path(
    model: CausalLM, groups: list[list[str]], driver: StandInDriver, refits: int
) -> dict[str, list[float]]:
    """The same buckets as the receiver read them before it kept its own map and skeletons:
    torch's ``rebuild_cuda_tensor`` on its cache (every share held), the whole pickle unpickled
    and its metadata read every bucket (``deserialize_payload``, ``bucket_items``), then the
    same plans and copies; the first refit builds the plans and is not timed."""
    key, _storage = hold_in_torchs_cache(driver)
    plans = CopyPlans()
    stages: dict[str, list[float]] = {f"torch path: {s}": [] for s in TORCH_PATH}
    for refit in range(refits + 1):
        weights = new_weights(model, refit)
        for names in groups:
            entry = serialize(driver, [(name, weights[name]) for name in names])
            t0 = time.perf_counter()
            payload = deserialize_payload(entry, torch_rebuild)
            t1 = time.perf_counter()
            flat_bytes, items = bucket_items(payload)
            t2 = time.perf_counter()
            plan = plans.get(model, items)
            t3 = time.perf_counter()
            with torch.no_grad():
                for step in plan.steps:
                    step.run(flat_bytes)
            t4 = time.perf_counter()
            del payload, flat_bytes
            if refit:
                seconds = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
                for sink, value in zip(stages.values(), seconds, strict=True):
                    sink.append(value)
    del reductions.shared_cache[key]
    return stages


if __name__ == "__main__":
    torch.set_num_threads(1)  # the copies on one thread, as the host path runs
    main()
