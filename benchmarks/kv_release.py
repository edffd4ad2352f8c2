# ruff: noqa: B023  (the closures below are called at once, inside their loop iteration)
"""Discarding and restoring a 32 GiB KV cache: the driver-call variants, and the memory layer's
overhead over the bare driver calls (issue 17, section 3: "measure every variant you try").

Every case starts after a 0.25 s idle gap (the trainer's step), as in sleep_wake.py, and is
repeated; medians with min and max.

- discard as N handles (N = 1, 4, 16, 64), unmapping and releasing each in turn, or unmapping all
  first and then releasing all; restore (create + map + set access) of the same handles;
- cuMemRelease of 32 GiB while an 8 GiB pinned D2H copy runs on another stream: does the release
  slow the copy, or the copy the release? (a level-1 sleep overlaps them); and the release
  started first in a helper thread with the copy enqueued while it runs (DiscardOrder THREAD):
  "release, copy under it" near "copy alone" means the release waits for the copy in flight;
  "copy, release under it" near copy + release means the two contend on the device;
- MemoryManager: the KV tag alone (one allocation), discard and restore, against the bare calls.

Usage: python benchmarks/kv_release.py [--out results.jsonl] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import GiB, Recorder, environment, table
from dormant.memory import MemoryManager
from dormant.memory.cuda_backend import CudaBackend

KV_BYTES = 32 * GiB
GAP_S = 0.25


def clock(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def stats(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def probe_handles(rec: Recorder, backend: CudaBackend, repeats: int) -> list[dict]:
    rows = []
    for count in (1, 4, 16, 64):
        size = KV_BYTES // count
        vas = [backend.reserve(size) for _ in range(count)]
        for order in ("interleaved", "unmap all, then release all"):
            discards, restores = [], []
            handles: list[int] = []

            def restore() -> None:
                handles.clear()
                for va in vas:
                    handles.append(backend.create(size))
                    backend.map(va, size, handles[-1])

            def discard() -> None:
                pairs = list(zip(vas, handles, strict=True))
                if order == "interleaved":
                    for va, handle in pairs:
                        backend.unmap(va, size)
                        backend.release(handle)
                    return
                for va, _ in pairs:
                    backend.unmap(va, size)
                for _, handle in pairs:
                    backend.release(handle)

            restore()
            for _ in range(repeats + 1):
                time.sleep(GAP_S)
                discards.append(clock(discard))
                time.sleep(GAP_S)
                restores.append(clock(restore))
            discard()
            for op, times in (("discard", discards[1:]), ("restore", restores[1:])):
                rows.append(rec.emit(case="kv handles", handles=count, order=order, op=op,
                                     **stats(times)))  # fmt: skip
        for va in vas:
            backend.free_reservation(va, size)
    return rows


def probe_overlap(rec: Recorder, backend: CudaBackend, repeats: int) -> list[dict]:
    """The release of 32 GiB and an 8 GiB D2H copy, alone and together."""
    device = torch.empty(8 * GiB, dtype=torch.uint8, device="cuda").fill_(1)
    host = torch.empty(8 * GiB, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    va = backend.reserve(KV_BYTES)
    timings: dict[str, list[float]] = {"copy alone": [], "release alone": []}
    timings.update({"copy, release under it": [], "release, copy under it": []})
    timings.update({"release in a thread, then the copy": [], "the release in that thread": []})
    for _ in range(repeats):
        handle = backend.create(KV_BYTES)
        backend.map(va, KV_BYTES, handle)
        time.sleep(GAP_S)
        timings["copy alone"].append(clock(lambda: host.copy_(device, non_blocking=True)))
        time.sleep(GAP_S)
        timings["release alone"].append(
            clock(lambda: (backend.unmap(va, KV_BYTES), backend.release(handle)))
        )
        handle = backend.create(KV_BYTES)
        backend.map(va, KV_BYTES, handle)
        time.sleep(GAP_S)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            host.copy_(device, non_blocking=True)
        release_start = time.perf_counter()
        backend.unmap(va, KV_BYTES)
        backend.release(handle)
        release_end = time.perf_counter()
        stream.synchronize()
        end = time.perf_counter()
        timings["copy, release under it"].append(end - start)
        timings["release, copy under it"].append(release_end - release_start)
        # The release first, in a helper thread, the copy enqueued while it runs (DiscardOrder
        # THREAD): does a release that starts on an idle device hide under a later copy?
        handle = backend.create(KV_BYTES)
        backend.map(va, KV_BYTES, handle)
        time.sleep(GAP_S)
        torch.cuda.synchronize()
        spans: list[float] = []
        start = time.perf_counter()
        releaser = threading.Thread(target=lambda: spans.append(timed_release(backend, va, handle)))
        releaser.start()
        with torch.cuda.stream(stream):
            host.copy_(device, non_blocking=True)
        releaser.join()
        stream.synchronize()
        timings["release in a thread, then the copy"].append(time.perf_counter() - start)
        timings["the release in that thread"].append(spans[0])
    backend.free_reservation(va, KV_BYTES)
    return [rec.emit(case="release under a copy", op=op, **stats(times))
            for op, times in timings.items()]  # fmt: skip


def timed_release(backend: CudaBackend, va: int, handle: int) -> float:
    start = time.perf_counter()
    backend.unmap(va, KV_BYTES)
    backend.release(handle)
    return time.perf_counter() - start


def probe_manager(rec: Recorder, repeats: int) -> list[dict]:
    mm = MemoryManager("cuda")
    kv = mm.empty((KV_BYTES,), torch.uint8, "kv_cache")
    sleeps, wakes = [], []
    for _ in range(repeats + 1):
        time.sleep(GAP_S)
        sleeps.append(clock(lambda: mm.sleep(tags={"kv_cache": "discard"})))
        time.sleep(GAP_S)
        wakes.append(clock(lambda: mm.wake_up(["kv_cache"])))
    case = "memory layer, one allocation"
    rows = [
        rec.emit(case=case, op="discard", **stats(sleeps[1:])),
        rec.emit(case=case, op="restore", **stats(wakes[1:])),
    ]
    del kv
    mm.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    rows = probe_manager(rec, args.repeats)  # first: the manager takes the device's slot
    backend = CudaBackend(torch.cuda.current_device())
    rows += probe_handles(rec, backend, args.repeats)
    rows += probe_overlap(rec, backend, args.repeats)
    for row in rows:
        row["median_ms"] = row["median_s"] * 1e3
    print(table(rows, ["case", "handles", "order", "op", "median_ms"]))


if __name__ == "__main__":
    main()
