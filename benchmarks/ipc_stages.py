"""Where the CUDA IPC refit's receiver spends its time, per bucket, in the stages
``IpcReceiver.update_weights_from_tensor`` runs: reading the entry (``PayloadSkeletons.read``:
rebuilding the tensor, opening the handle or finding it held, and finding the bucket's layout,
its metadata unpickled on the bucket's first read only), looking up its copy plan (built on the
first refit only), enqueueing the plan's copies, synchronizing, and ending the payload (closing
the previous bucket's handle unless it was reused); and the parts of the read (``PARTS``:
opening a handle, releasing a held one's counter, waiting on its event). A second process sends
the 8B-like model's bf16 weights in flattened buckets (``benchmarks/refit.py``'s sender); prints
one JSON line per stage with its median, mean, 90th-percentile and largest milliseconds per
bucket (a refit's sum is the mean's: a tail counts), and per sender the copies per
bucket, the handles opened and reused, the counter files mapped and the counters released, and
the reads that found a kept layout (skeleton hits) or read the bucket in full (misses).

Also per bucket: "copy on device", the plan's copies timed by CUDA events around them, and
"whole call", ``update_weights_from_tensor`` itself in ``--refits`` more refits (what
``benchmarks/refit.py`` sums as the engine side). ``--synced``: the sender finishes each
bucket's packing before it sends it (``refit.py``'s engine-side mode), so no stage waits on it.

    python benchmarks/ipc_stages.py [--bucket-mib 512] [--synced] [--modes new,reuse,pipelined]
        [--profile] [--read-parts] [--out stages.jsonl]

``--profile``: cProfile's top functions (by their own time) of each mode's whole calls, printed.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder
from benchmarks.decode import QWEN3_8B_LIKE
from benchmarks.refit import build, sender_main
from dormant.models import ModelConfig
from dormant.worker import ipc_skeletons
from dormant.worker.copy_plan import wait_for_copies
from dormant.worker.ipc_handles import IpcHandles
from dormant.worker.ipc_receiver import IpcReceiver
from dormant.worker.ipc_weights import FLATTENED_BUCKET

STAGES = ("read", "plan", "copy", "sync", "end payload")
# Parts of "read" (IpcHandles' calls, summed per bucket that made them): "rebuild: open"
# (``_new_shared_cuda``: opening a handle, its event waited on inside), "rebuild: counter"
# (releasing a held handle's share counter) and "rebuild: event" (waiting on its IPC event).
PARTS = {"_open": "rebuild: open", "_wait_on_event": "rebuild: event"}
COUNTER_PART = "rebuild: counter"
# With --read-parts, also the read's own parts (each wrapped, so "read" grows by the wrappers):
# "read: decode" (base64), "read: split" (finding the argument tuple), "read: unpickle" (the
# head, its rebuild included), "read: rebuild" (``IpcHandles.rebuild_cuda_tensor``), "read:
# match" (the memo against the kept skeleton) and "read: layout" (the buffer's bytes and layout).
READ_PARTS = {
    "decode_entry": "read: decode", "_split": "read: split", "unpickle_entry": "read: unpickle",
}  # fmt: skip
SKELETON_PARTS = {"matches": "read: match", "items": "read: layout"}
# Also timed: "sender", from the acknowledgement to the next bucket's arrival (the trainer
# packing and serializing), and "release", closing the last handle at the end of a refit.


def timed(fn: Callable[..., Any], sink: list[float]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            sink.append(time.perf_counter() - start)

    return call


def time_parts(receiver: IpcReceiver) -> dict[str, list[float]]:
    """Times the receiver's handle parts; returns the sinks, one duration per call."""
    handles = receiver.handles
    sinks: dict[str, list[float]] = {part: [] for part in (*PARTS.values(), COUNTER_PART)}
    for attribute, part in PARTS.items():
        setattr(handles, attribute, timed(getattr(handles, attribute), sinks[part]))
    counters = handles.counters
    counters.release = timed(counters.release, sinks[COUNTER_PART])  # type: ignore[method-assign]
    return sinks


def time_read_parts() -> dict[str, list[float]]:
    """Wraps the read's functions in every receiver of this process; returns their sinks."""
    sinks: dict[str, list[float]] = {}
    for attribute, part in READ_PARTS.items():
        sinks[part] = []
        setattr(ipc_skeletons, attribute, timed(getattr(ipc_skeletons, attribute), sinks[part]))
    for attribute, part in SKELETON_PARTS.items():
        sinks[part] = []
        skeleton = ipc_skeletons._Skeleton
        setattr(skeleton, attribute, timed(getattr(skeleton, attribute), sinks[part]))
    sinks["read: rebuild"] = []
    rebuild = IpcHandles.rebuild_cuda_tensor
    IpcHandles.rebuild_cuda_tensor = timed(rebuild, sinks["read: rebuild"])  # type: ignore[method-assign]
    return sinks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--refits", type=int, default=3)
    parser.add_argument("--synced", action="store_true", help="the sender syncs before sending")
    parser.add_argument("--modes", default="new,reuse,pipelined", help="the senders' modes")
    parser.add_argument("--profile", action="store_true", help="cProfile the whole calls")
    parser.add_argument("--read-parts", action="store_true", help="time the read's parts")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    command = "run synced" if args.synced else "run"
    device = torch.device("cuda")
    model = build(ModelConfig.from_dict(QWEN3_8B_LIKE), device)
    shapes = {n: tuple(s) for n, s in model.expected_weight_shapes().items()}
    recorder = Recorder(args.out)
    read_parts = time_read_parts() if args.read_parts else {}
    for mode in args.modes.split(","):
        conn, child = get_context("spawn").Pipe()
        sender = get_context("spawn").Process(
            target=sender_main, args=(child, shapes, "cuda", args.bucket_mib * MiB, 3, mode)
        )
        sender.start()
        conn.recv()
        receiver = IpcReceiver()
        parts = {**time_parts(receiver), **read_parts}
        stages: dict[str, list[float]] = {
            k: [] for k in (*STAGES, "copy on device", "whole call", "sender", "release", *parts)
        }
        copy_start, copy_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
        for _ in range(args.refits):
            conn.send(command)
            acknowledged = None
            while (entries := conn.recv()) is not None:
                for sink in parts.values():
                    sink.clear()
                t0 = time.perf_counter()
                if acknowledged is not None:
                    stages["sender"].append(t0 - acknowledged)
                rebuild = receiver.handles.rebuild_cuda_tensor
                flat_bytes, items = receiver.skeletons.read(entries[0], rebuild)
                t1 = time.perf_counter()
                plan = receiver.plans.get(model, items)
                t2 = time.perf_counter()
                copy_start.record()
                for step in plan.steps:
                    step.run(flat_bytes)
                copy_end.record()
                t3 = time.perf_counter()
                wait_for_copies({flat_bytes.device})
                t4 = time.perf_counter()
                stages["copy on device"].append(copy_start.elapsed_time(copy_end) / 1e3)
                del flat_bytes
                receiver.handles.end_payload()
                t5 = time.perf_counter()
                times = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
                for key, value in zip(STAGES, times, strict=True):
                    stages[key].append(value)
                for part, sink in parts.items():
                    if sink:
                        stages[part].append(sum(sink))
                conn.send(True)
                acknowledged = time.perf_counter()
            t0 = time.perf_counter()
            receiver.release()
            stages["release"].append(time.perf_counter() - t0)
        profile = cProfile.Profile() if args.profile else None
        for _ in range(args.refits):
            conn.send(command)
            while (entries := conn.recv()) is not None:
                t0 = time.perf_counter()
                if profile is not None:
                    profile.enable()
                receiver.update_weights_from_tensor(model, entries, load_format=FLATTENED_BUCKET)
                if profile is not None:
                    profile.disable()
                stages["whole call"].append(time.perf_counter() - t0)
                conn.send(True)
            receiver.release()
        if profile is not None:
            print(f"== {mode}: the whole calls under cProfile (the stage times above are not)")
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        conn.send("stop")
        sender.join()
        for stage, values in stages.items():
            if not values:
                continue
            ordered = sorted(values)
            recorder.emit(
                case="ipc receiver stage", sender=mode, stage=stage, buckets=len(values),
                bucket_mib=args.bucket_mib,
                median_ms=statistics.median(values) * 1e3, mean_ms=statistics.mean(values) * 1e3,
                p90_ms=ordered[int(0.9 * (len(ordered) - 1))] * 1e3, max_ms=ordered[-1] * 1e3,
            )  # fmt: skip
        plans = receiver.plans.of(model)
        recorder.emit(
            case="ipc receiver totals", sender=mode, refits=args.refits,
            copies_per_bucket=statistics.mean(p.num_copies for p in plans),
            handles_opened=receiver.handles.num_opened, handles_reused=receiver.handles.num_reused,
            counter_files_mapped=receiver.handles.counters.num_mapped,
            skeleton_hits=receiver.skeletons.num_hits,
            skeleton_misses=receiver.skeletons.num_misses,
            counters_released=receiver.handles.counters.num_released,
        )  # fmt: skip


if __name__ == "__main__":
    main()
