"""Is an IPC bucket's host time the receiver's code, or the host's state after it waited (issue 13)?

``refit.py``'s engine side spends 0.28-0.34 ms of host time per 512 MiB bucket beside its copy
on the GPU hosts measured (0.2-0.39 ms on H200 hosts), while the same receive with a stand-in
driver on a CPU (``ipc_host.py``) spends about 0.06 ms beyond its copy. In ``refit.py`` each call
follows a wait of about a millisecond in a blocking read, for the sender's next bucket; here every
bucket of every round is packed, synchronized and sent before the first call, so the receiver
decides what it does between calls:

    gap        between calls
    ─────────  ─────────────────────────────────────────────────────────────────────────
    none       nothing: the calls run back to back
    sleep N    ``time.sleep``: the thread blocks for N microseconds
    spin N     a busy loop for N microseconds: the core never idles
    ping       a round trip to the sender over the pipe, nothing on the GPU
    touch      the same, the sender having run one small kernel and synchronized: the GPU
               last ran another process's work (a context switch before the call's)
    pack       the same, the sender having copied a bucket's bytes (``refit.py``'s sender
               packs each bucket so, and synchronizes, before it sends it)

for buckets whose handle is opened by the call (``new``: every bucket its own allocation, slime's
way) and for shares of one buffer whose handle is held (``held``: one layers' bucket shared again
and again, as verl's reused buffer is). The rounds alternate kinds, so the host's drift over the
run spreads over all. Prints per (sender, gap) the median wall time of a call, and the median of
each call less its bucket's copy (that bucket's device time, CUDA events around the plan's
copies, in calls timed apart): the host's part. If "sleep" calls cost far more than "none" and
"spin" ones, the host's state after a blocking wait is what a bucket pays; if "touch" and "pack"
calls cost far more than "ping" ones, it is the GPU's switch from another process's work.
``--prods``: each call first submits a little work to the GPU (``PRODS``: an event record or a
one-byte memset), so that a switch it causes runs beside the receiver's host work.

    python benchmarks/ipc_idle_gap.py [--rounds 3] [--gaps-us 200,1000] [--out gap.jsonl]
        [--bucket-mib 512] [--prods none,event,memset]
    python benchmarks/ipc_idle_gap.py --tiny   (a tiny model on the CPU: checks the script runs)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder
from benchmarks.decode import QWEN3_8B_LIKE
from benchmarks.refit import TINY, Shapes, build, source_weights
from dormant.models import CausalLM, ModelConfig
from dormant.worker.ipc_receiver import IpcReceiver
from dormant.worker.ipc_weights import (
    FLATTENED_BUCKET,
    iter_buckets,
    pack_flattened_bucket,
    serialize_for_update,
)

SENDERS = ("new", "held")
# Work submitted to the GPU first thing in a call, before the receiver's host work: if the GPU
# switches to this process's context on any submission, the switch then runs beside that work.
PRODS = ("none", "event", "memset")
PIPE_GAPS = ("ping", "touch", "pack")  # gaps the sender answers, after that work on the device


def sender_main(conn: Connection, shapes: Shapes, device: str, bucket_bytes: int) -> None:
    """Packs every bucket into a buffer of its own, and a layers' bucket once more into the held
    buffer; then answers each ("new" | "held", count) with that many fresh shares: of the buckets
    in turn, or of the held buffer again and again. Every share is made after the packing was
    synchronized, and each has its own IPC event and counter slot. Answers each of ``PIPE_GAPS``
    once its work on the device is done. Keeps the buffers until "stop"."""
    weights = source_weights(shapes, torch.bfloat16, torch.device(device), 1)
    buckets = list(iter_buckets(weights, bucket_bytes))
    payloads = [_packed(bucket, bucket_bytes, device) for bucket in buckets]
    held = _packed(buckets[len(buckets) // 2], bucket_bytes, device)  # a layers' bucket
    scratch = torch.zeros(1024, device=device)
    spare = torch.empty_like(held["flattened_tensor"])
    work = {
        "ping": lambda: None,
        "touch": lambda: scratch.add_(1),
        "pack": lambda: spare.copy_(held["flattened_tensor"]),
    }
    synchronize()
    conn.send(len(payloads))
    while (command := conn.recv()) != "stop":
        if command in work:
            work[command]()
            synchronize()
            conn.send(None)
            continue
        sender, count = command
        shared = [held] * count if sender == "held" else payloads * (count // len(payloads))
        conn.send([serialize_for_update(payload) for payload in shared])


def _packed(bucket: list, bucket_bytes: int, device: str) -> dict:
    largest = max(t.numel() * t.element_size() for _, t in bucket)
    buffer = torch.empty(max(bucket_bytes, largest), dtype=torch.uint8, device=device)
    return pack_flattened_bucket(buffer, bucket)


def synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def idle(conn: Connection, gap: str, microseconds: int) -> None:
    """Waits as ``gap`` says (see above): ``microseconds`` blocking ("sleep") or busy ("spin"),
    or for the sender's answer to ``gap`` (``PIPE_GAPS``)."""
    if gap == "sleep":
        time.sleep(microseconds / 1e6)
    elif gap == "spin":
        end = time.perf_counter() + microseconds / 1e6
        while time.perf_counter() < end:
            pass
    elif gap in PIPE_GAPS:
        conn.send(gap)
        conn.recv()


def timed_calls(
    receiver: IpcReceiver,
    model: CausalLM,
    entries: list,
    wait: Callable[[], None],
    prod: Callable[[], object] = lambda: None,
) -> list[float]:
    """Each entry's ``update_weights_from_tensor`` wall time, ``wait()`` before each and
    ``prod()`` first inside it (``PRODS``); then the refit is ended (``release``), as the worker
    ends it."""
    times = []
    for entry in entries:
        wait()
        start = time.perf_counter()
        prod()
        receiver.update_weights_from_tensor(model, [entry], load_format=FLATTENED_BUCKET)
        times.append(time.perf_counter() - start)
    receiver.release()
    return times


def prod_calls(device: torch.device) -> dict[str, Callable[[], object]]:
    """Each of ``PRODS`` as a call: an event recorded on the current stream, or one byte set."""
    if device.type != "cuda":
        return dict.fromkeys(PRODS, lambda: None)
    event, byte = torch.cuda.Event(), torch.zeros(1, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device)
    return {"none": lambda: None, "event": lambda: event.record(stream), "memset": byte.zero_}


def copy_seconds(receiver: IpcReceiver, model: CausalLM, entries: list) -> list[float]:
    """The device time of each entry's copies (CUDA events around the plan's steps, in calls of
    their own: the events' records are not in the timed calls)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for entry in entries:
        flat_bytes, items = receiver.skeletons.read(entry, receiver.handles.rebuild_cuda_tensor)
        plan = receiver.plans.get(model, items)
        start.record()
        plan.run(model, flat_bytes)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        del flat_bytes
        receiver.handles.end_payload()
    receiver.release()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every (sender, gap)")
    parser.add_argument("--gaps-us", default="200,1000", help="idle gaps, microseconds")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--prods", default="none", help=f"comma-separated, of {PRODS}")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        gaps_us = [int(word) for word in args.gaps_us.split(",")]
    except ValueError:
        parser.error(f"--gaps-us takes microseconds, comma-separated; got {args.gaps_us!r}")
    if any(gap <= 0 for gap in gaps_us):
        parser.error(f"--gaps-us must be positive; got {args.gaps_us!r}")
    gaps = [("none", 0)] + [(kind, us) for us in gaps_us for kind in ("sleep", "spin")]
    gaps += [(kind, 0) for kind in PIPE_GAPS]
    prods = args.prods.split(",")
    if unknown := set(prods) - set(PRODS):
        parser.error(f"unknown --prods {sorted(unknown)}; choose from {list(PRODS)}")
    device = torch.device("cpu" if args.tiny else "cuda")
    model = build(ModelConfig.from_dict(TINY if args.tiny else QWEN3_8B_LIKE), device)
    shapes = {n: tuple(s) for n, s in model.expected_weight_shapes().items()}
    conn, child = get_context("spawn").Pipe()
    process = get_context("spawn").Process(
        target=sender_main, args=(child, shapes, str(device), args.bucket_mib * MiB)
    )
    process.start()
    num_buckets = conn.recv()
    recorder = Recorder(args.out)
    recorder.emit(
        case="ipc idle gap setup", device=str(device), torch=torch.__version__,
        buckets_per_refit=num_buckets, bucket_mib=args.bucket_mib, rounds=args.rounds,
    )  # fmt: skip
    receiver = IpcReceiver()

    def shares(sender: str) -> list:
        conn.send((sender, num_buckets))
        return conn.recv()

    for sender in SENDERS:  # the plans are built, the handles' first costs paid
        timed_calls(receiver, model, shares(sender), lambda: None)
    on_gpu = device.type == "cuda"
    copies = {s: copy_seconds(receiver, model, shares(s)) for s in SENDERS} if on_gpu else {}
    submit = prod_calls(device)
    calls: dict[tuple[str, str, int, str], list[float]] = {}
    hosts: dict[tuple[str, str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for prod in prods:
            for sender in SENDERS:
                for gap, us in gaps:
                    wait = partial(idle, conn, gap, us)
                    times = timed_calls(receiver, model, shares(sender), wait, submit[prod])
                    key = (sender, gap, us, prod)
                    calls.setdefault(key, []).extend(times)
                    if copies:  # each call less its own bucket's copy
                        copy = copies[sender]
                        host = [t - copy[i % len(copy)] for i, t in enumerate(times)]
                        hosts.setdefault(key, []).extend(host)
    conn.send("stop")
    process.join()
    for key, times in calls.items():
        sender, gap, us, prod = key
        recorder.emit(
            case="ipc idle gap", sender=sender, gap=gap, gap_us=us, prod=prod, calls=len(times),
            call_us=statistics.median(times) * 1e6,
            copy_us=statistics.median(copies[sender]) * 1e6 if copies else None,
            host_us=statistics.median(hosts[key]) * 1e6 if copies else None,
            p90_call_us=sorted(times)[int(0.9 * (len(times) - 1))] * 1e6,
        )  # fmt: skip


if __name__ == "__main__":
    main()
