"""The host's cost of each CUDA call an IPC bucket's receive makes, one at a time (issue 13).

A second process on the same GPU shares one 512 MiB buffer again and again, as verl's reusing
sender does: it writes the buffer, shares it (``reduce_tensor``: a new IPC event and counter slot
each time) and waits for the receiver's acknowledgement. The receiver opened the buffer's handle
once and, per share, times each call the engine's receive path makes, in its order:

    step        call
    ──────────  ─────────────────────────────────────────────────────────────────
    stream      ``torch.cuda.current_stream(device)``
    open event  ``torch.cuda.Event.from_ipc_handle`` (``cudaIpcOpenEventHandle``)
    wait event  ``Event.wait(stream)`` (``cudaStreamWaitEvent``)
    view        ``as_strided`` of the held storage, ``view(uint8)``, a slice (and an event
                record)
    enqueue     ``dst.copy_(src)``: the 512 MiB copy
    sync        ``stream.synchronize()``: until the copy ends
    destroy     dropping the opened event (``cudaEventDestroy``)

in four ways: as the engine does (the sender's event waited on), into a torch allocation or into
a ``weights`` pool of a ``MemoryManager`` (VMM-mapped, as the engine's parameters are); without
the wait (the sender synchronized before it shared: only the enqueue's cost after a
cross-process wait differs); and from a local buffer (no IPC at all). The copy's device time
is timed by CUDA events around it. Prints one JSON line per (way, step): median, 10th and 90th
percentile microseconds.

    python benchmarks/ipc_primitives.py [--repeats 200] [--out primitives.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from torch.multiprocessing import reductions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder
from dormant.memory import WEIGHTS, MemoryManager

BUCKET = 512 * MiB
WAYS = ("ipc event", "ipc event, pool", "no event", "local")
STEPS = ("stream", "open event", "wait event", "view", "enqueue", "sync", "destroy event")
TIMED = (*STEPS, "copy on device")


def _sender(conn: Connection, synchronize: bool) -> None:
    """Writes and shares its buffer on each request, until told to stop."""
    buffer = torch.empty(BUCKET, dtype=torch.uint8, device="cuda")
    value = 0
    while conn.recv() != "stop":
        value = (value + 1) % 251
        buffer.fill_(value)
        if synchronize:
            torch.cuda.synchronize()
        conn.send((value, reductions.reduce_tensor(buffer)[1]))


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6  # noqa: E731
    return {"median_us": statistics.median(values) * 1e6, "p10_us": pick(0.1), "p90_us": pick(0.9)}


def measure(way: str, repeats: int, recorder: Recorder) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    memory = MemoryManager("cuda") if way.endswith("pool") else None
    if memory is not None:
        dst = memory.empty((BUCKET,), torch.uint8, WEIGHTS)
    else:
        dst = torch.empty(BUCKET, dtype=torch.uint8, device=device)
    local = torch.full((BUCKET,), 3, dtype=torch.uint8, device=device)
    ctx = get_context("spawn")
    conn, child = ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(child, way == "no event"))
    sender.start()
    times: dict[str, list[float]] = {step: [] for step in TIMED}
    held = None  # the first share's tensor: its storage stays open, as the receiver holds it
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for index in range(repeats + 5):
        conn.send("share")
        value, args = conn.recv()
        if held is None:
            held = reductions.rebuild_cuda_tensor(*args)  # opens the handle, waits on its event
            continue
        size, stride, offset, event_handle = args[1], args[2], args[3], args[13]
        t0 = time.perf_counter()
        stream = torch.cuda.current_stream(device)
        t1 = time.perf_counter()
        event = (
            torch.cuda.Event.from_ipc_handle(device, event_handle)
            if way.startswith("ipc event")
            else None
        )
        t2 = time.perf_counter()
        if event is not None:
            event.wait(stream)
        t3 = time.perf_counter()
        if way == "local":
            src = local
        else:
            src = held.as_strided(size, stride, offset).view(torch.uint8)[:BUCKET]
        begin.record(stream)
        t4 = time.perf_counter()
        dst.copy_(src)
        t5 = time.perf_counter()
        end.record(stream)
        stream.synchronize()
        t6 = time.perf_counter()
        del event
        t7 = time.perf_counter()
        if way != "local":
            sample = int(dst[BUCKET // 2].item())  # the sender's writes arrived before the copy
            if sample != value:
                raise RuntimeError(f"{way}: read {sample}, the sender wrote {value}")
        if index >= 5:
            stamps = (t0, t1, t2, t3, t4, t5, t6, t7)
            for step, a, b in zip(STEPS, stamps, stamps[1:], strict=False):
                times[step].append(b - a)
            times["copy on device"].append(begin.elapsed_time(end) / 1e3)
        del src
    conn.send("stop")
    sender.join()
    del dst, held
    if memory is not None:
        memory.close()
    for step, values in times.items():
        recorder.emit(case="ipc primitive", way=way, step=step, samples=len(values),
                      **_percentiles(values))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    recorder = Recorder(args.out)
    recorder.emit(case="setup", torch=torch.__version__, gpu=torch.cuda.get_device_name())
    for way in WAYS:
        measure(way, args.repeats, recorder)
    print(f"{'way':16} " + " ".join(f"{step:>14}" for step in TIMED))
    for way in WAYS:
        rows = {r["step"]: r for r in recorder.rows if r.get("way") == way}
        print(f"{way:16} " + " ".join(f"{rows[s]['median_us']:14.1f}" for s in TIMED))


if __name__ == "__main__":
    main()
