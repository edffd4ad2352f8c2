"""Refit speed of an 8B-like bf16 model (~16 GB of weights), every path side by side in one run.

Cases (issue 13):
  - limit: one device-to-device copy of the same number of bytes;
  - bf16: same-process bf16 tensors, one ``model.load_weights`` call;
  - fp32 cast: same-process fp32 tensors, cast on copy, one call;
  - ipc bucket: CUDA IPC handles from a second process on the same GPU, flattened buckets
    (default 512 MiB) through ``IpcReceiver.update_weights_from_tensor(load_format=
    "flattened_bucket")``, one receiver per sender mode (its copy plans and held handles, as a
    worker's); each mode is timed twice: end to end (the sender packs each bucket, as slime and
    verl do), and engine side (the sender finished packing before it sends, and only the
    receiver's calls are summed; ``--spin``: it polls for each bucket in a busy loop instead
    of sleeping in a blocking read);
  - trl loop: ``load_weights([(name, tensor)])`` one tensor at a time (fp32, TRL's default policy,
    and bf16), the baseline.
Each case prints a JSON line: seconds (median of ``--repeats``), GB/s of weight bytes,
``of_limit`` (the limit's time over the case's; target >= 0.5 for the bucketed bf16 paths),
``x_limit`` (its inverse), and the peak extra device memory: the allocator's high-water mark above
what was allocated before the case (for IPC, the receiver's own allocations; the sender's are its
own). IPC rows add ``engine_s`` / ``engine_of_limit`` (the engine-side time), the copies per
bucket, the handles opened and reused per refit, the sender's counter files the receiver mapped
per refit, and ``sender_unreleased_bytes``: what the sender could not free once it dropped its
buffers (0: every share's counter was released). A packed bucket moves every byte twice (the
sender's pack, the engine's copy-in, on the same HBM), so end to end a packed mode is bounded at
0.5 x the limit even with no latency at all; only ``direct`` (no packing) is not. The model is
built as the engine builds it (on meta, adopted into a memory manager's ``weights`` pool: the
parameters are back to back in module order). Not measured here: the time until the engine
generates (``benchmarks/refit_to_generate.py``).

Usage: python benchmarks/refit.py [--out results.jsonl] [--bucket-mib 512] [--repeats 5]
           [--modes new,reuse,pipelined,direct] [--spin]
       python benchmarks/refit.py --tiny   (a tiny model on the CPU: checks the script runs)
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder, table
from benchmarks.decode import QWEN3_8B_LIKE
from dormant.memory import WEIGHTS, MemoryManager
from dormant.models import CausalLM, ModelConfig, build_model
from dormant.worker.ipc_receiver import IpcReceiver
from dormant.worker.ipc_weights import (
    FLATTENED_BUCKET,
    flattened_bucket_request,
    iter_buckets,
    pack_flattened_bucket,
    serialize_for_update,
)

TINY = {
    **QWEN3_8B_LIKE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
}  # fmt: skip
Shapes = dict[str, tuple[int, ...]]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    fn: Callable[[], Any], device: torch.device, repeats: int
) -> tuple[list[float], int | None]:
    """Wall times of ``fn()`` with the device idle before and after, and the peak device memory
    it allocated above what was allocated before (None on the CPU)."""
    gc.collect()
    times = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return times, peak


def source_weights(shapes: Shapes, dtype: torch.dtype, device: torch.device, seed: int) -> list:
    """Deterministic new weights: the same values in every process for the same seed."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = []
    for name, shape in shapes.items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        weights.append((name, tensor.normal_(0.0, 0.02, generator=generator)))
    return weights


def copy_limit(
    num_bytes: int, device: torch.device, repeats: int
) -> tuple[list[float], int | None]:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), device, repeats)


def one_by_one(model: CausalLM, weights: list[tuple[str, Tensor]]) -> None:
    for item in weights:
        model.load_weights([item])


def checksum(tensors: list[Tensor]) -> float:
    return math.fsum(float(t.double().sum()) for t in tensors)


# ── the second process: a trainer that sends CUDA IPC buckets ──────────────────────────────


SENDER_MODES = {
    "new": "a new buffer each",
    "reuse": "one reused buffer",
    "pipelined": "two halves of one buffer, the next packed while the engine copies",
    "direct": "the trainer's own tensors, no packing",
}
PACKED_BOUND = 0.5  # of the limit, end to end: a packed byte is written twice


def sender_main(
    conn: Connection, shapes: Shapes, device: str, bucket_bytes: int, seed: int, mode: str
) -> None:
    """Sends the weights on every "run" (or "run synced": each bucket's packing finished before
    it is sent), in buckets, by ``mode`` (``SENDER_MODES``): ``new``, every bucket a new buffer
    with a new handle (slime's way); ``reuse``, one persistent buffer packed again for every
    bucket (verl's way); ``pipelined``, the two halves of one persistent allocation (one IPC
    handle), bucket k+1 packed and sent before the engine acknowledged bucket k; ``direct``,
    handles of the weights themselves (``load_format=None``), nothing packed. On "free" (then
    only "stop" may follow) it drops its buffers and sends what it could not free."""
    weights = source_weights(shapes, torch.bfloat16, torch.device(device), seed)
    conn.send(checksum([t for _, t in weights]))
    allocated = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    largest = max(t.numel() * t.element_size() for _, t in weights)
    size = max(bucket_bytes, largest) + (1 << 20)
    num_buffers = {"reuse": 1, "pipelined": 2}.get(mode, 0)
    allocation = torch.empty(size * num_buffers, dtype=torch.uint8, device=device)
    buffers = [allocation[i * size : (i + 1) * size] for i in range(num_buffers)]
    # Buckets the engine may still be reading when the next one is packed: a buffer is packed
    # again only once the engine acknowledged the bucket it held.
    in_flight_limit = 1 if mode == "pipelined" else 0
    payload: dict | None = None
    while (command := conn.recv()) != "stop":
        if command == "free":  # the last command before "stop"
            allocation, buffers, payload = torch.empty(0), [], None
            conn.send(_unreleased_bytes(device, allocated))
            continue
        in_flight = 0
        for index, bucket in enumerate(iter_buckets(weights, bucket_bytes)):
            flat = None
            if mode == "direct":
                entries = [serialize_for_update(bucket)]
            elif buffers:
                payload = pack_flattened_bucket(buffers[index % len(buffers)], bucket)
                entries = [serialize_for_update(payload)]
            else:
                entries, flat = flattened_bucket_request(bucket)
            if command == "run synced" and device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send(entries)
            in_flight += 1
            while in_flight > in_flight_limit:
                conn.recv()  # the engine returned: its copies of that bucket are done
                in_flight -= 1
            del entries, flat
            if device.startswith("cuda") and mode == "new":
                torch.cuda.ipc_collect()
        for _ in range(in_flight):
            conn.recv()
        conn.send(None)


def _unreleased_bytes(device: str, allocated: int) -> int:
    """What the sender still has allocated beyond its weights once it dropped its buffers and
    collected its IPC blocks: 0 when the engine released every share's counter (torch's
    producer frees a shared block only then)."""
    if not device.startswith("cuda"):
        return 0
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return torch.cuda.memory_allocated() - allocated


def receive(conn: Connection, spin: bool) -> Any:
    """The sender's next message. ``spin``: polled in a busy loop, so the receiving thread never
    sleeps between buckets (as vLLM's shared-memory message queue spins before it blocks),
    instead of a blocking read."""
    if spin:
        while not conn.poll():
            pass
    return conn.recv()


def ipc_case(
    receiver: IpcReceiver,
    model: CausalLM,
    conn: Connection,
    load_format: str | None,
    command: str,
    spin: bool = False,
) -> float:
    """One refit from the sender, ended as the worker ends it (``release``); returns the
    receiver-side seconds (inside the update calls, and the release)."""
    inside = 0.0
    conn.send(command)
    while (entries := receive(conn, spin)) is not None:
        start = time.perf_counter()
        receiver.update_weights_from_tensor(model, entries, load_format=load_format)
        inside += time.perf_counter() - start
        conn.send(True)
    start = time.perf_counter()
    receiver.release()
    return inside + time.perf_counter() - start


def refit_into(
    sink: dict[str, list[float]], case: Callable[[str, bool], float], command: str, spin: bool
) -> None:
    """``case`` (an ``ipc_case`` bound to its receiver, model, pipe and format) run for
    ``command``, its seconds kept in ``sink[command]``."""
    sink[command].append(case(command, spin))


# ── the run ────────────────────────────────────────────────────────────────────────────────


def build(config: ModelConfig, device: torch.device) -> CausalLM:
    """The model as the worker builds it: on meta, then adopted into a ``weights`` pool."""
    with torch.device("meta"):
        model = build_model(config)
    memory = MemoryManager("host" if device.type == "cpu" else str(device))
    memory.adopt(model, tag=WEIGHTS)
    model.memory = memory  # the pool lives as long as the model
    model.init_buffers()
    model.reset_kv_scales()
    model.init_random_weights(0)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--modes", default=",".join(SENDER_MODES), help="the IPC sender modes, comma-separated"
    )
    parser.add_argument(
        "--spin", action="store_true", help="the engine side polls for buckets (never sleeps)"
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(SENDER_MODES):
        parser.error(f"unknown --modes {sorted(unknown)}; choose from {list(SENDER_MODES)}")
    rec = Recorder(args.out)
    device = torch.device("cpu" if args.tiny else "cuda")
    config = ModelConfig.from_dict(TINY if args.tiny else QWEN3_8B_LIKE)
    model = build(config, device)
    params = list(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    shapes = {n: tuple(s) for n, s in model.expected_weight_shapes().items()}
    rec.emit(
        case="setup",
        device=str(device),
        torch=torch.__version__,
        weight_bytes=weight_bytes,
        num_tensors=len(shapes),
        bucket_bytes=args.bucket_mib * MiB,
        repeats=args.repeats,
        modes=modes,
        spin=args.spin,
    )
    rows: list[dict[str, Any]] = []

    def report(case: str, times: list[float], peak: int | None, **extra: Any) -> None:
        seconds = statistics.median(times)
        limit = rows[0]["seconds"] if rows else seconds
        row = rec.emit(
            case=case,
            seconds=seconds,
            min_s=min(times),
            max_s=max(times),
            gbps=weight_bytes / seconds / 1e9,
            x_limit=seconds / limit,
            of_limit=limit / seconds,
            peak_extra_bytes=peak,
            **extra,
        )
        rows.append(row)

    report("limit (one device-to-device copy)", *copy_limit(weight_bytes, device, args.repeats))
    for dtype, seed in ((config.dtype, 1), (torch.float32, 2)):
        weights = source_weights(shapes, dtype, device, seed)
        name = "bf16" if dtype == torch.bfloat16 else f"{str(dtype).removeprefix('torch.')} cast"
        one_call = measure(partial(model.load_weights, weights), device, args.repeats)
        report(f"{name}, one load_weights call", *one_call)
        loop = measure(partial(one_by_one, model, weights), device, args.repeats)
        report(f"trl loop, {name}, one tensor per call", *loop)
        weights = []

    for mode in modes:
        how = SENDER_MODES[mode]
        ctx = get_context("spawn")
        conn, child = ctx.Pipe()
        sender = ctx.Process(
            target=sender_main,
            args=(child, shapes, str(device), args.bucket_mib * MiB, 3 + len(rows), mode),
        )
        sender.start()
        sent_checksum = conn.recv()
        receiver = IpcReceiver()
        load_format = None if mode == "direct" else FLATTENED_BUCKET
        inside: dict[str, list[float]] = {"run": [], "run synced": []}

        case = partial(ipc_case, receiver, model, conn, load_format)
        refit = partial(refit_into, inside, case)
        engine_side, _ = measure(partial(refit, "run synced", args.spin), device, args.repeats)
        handles = receiver.handles
        opened, reused = handles.num_opened, handles.num_reused
        times, peak = measure(partial(refit, "run", False), device, args.repeats)
        received = checksum([p.detach() for p in params])
        conn.send("free")
        unreleased = conn.recv()
        conn.send("stop")
        sender.join()
        plans = receiver.plans.of(model)
        engine_s = statistics.median(inside["run synced"])
        report(
            f"ipc buckets of {args.bucket_mib} MiB, {how} (end to end)",
            times,
            peak,
            receiver_s=statistics.median(inside["run"]),
            engine_s=engine_s,
            engine_of_limit=rows[0]["seconds"] / engine_s,
            engine_wall_s=statistics.median(engine_side),
            end_to_end_bound=None if mode == "direct" else PACKED_BOUND,
            copies_per_bucket=statistics.mean(p.num_copies for p in plans) if plans else None,
            handles_opened_per_refit=opened / args.repeats,
            handles_reused_per_refit=reused / args.repeats,
            verified=math.isclose(received, sent_checksum, rel_tol=1e-9),
            sender_unreleased_bytes=unreleased,
            counter_files_mapped_per_refit=handles.counters.num_mapped / (2 * args.repeats),
        )
    print(
        f"Packed modes move every byte twice (pack, then copy-in): end to end they are bounded at "
        f"{PACKED_BOUND} x the limit; engine_of_limit is the engine's side alone."
    )
    columns = ["case", "seconds", "gbps", "of_limit", "engine_of_limit", "copies_per_bucket"]
    print(table(rows, [*columns, "peak_extra_bytes"]))


if __name__ == "__main__":
    main()
