"""What a large release slows down, and for how long (issue 17, the engine's wake right after a
sleep).

``wake_after_release.py`` (results/2026-12-02d-run2-wake_after_release.jsonl) showed that a
level-1 wake of 16 GiB of weights that starts right after a sleep released 60-75 GB of KV runs at
1.5 x the pinned-copy limit, and at 1.07 x once 0.25 s have passed since that release, whatever
the weights did. Hypothesis: the driver reclaims (scrubs) the released memory for a fraction of a
second after ``cuMemRelease`` returns, with the copy engines that host-to-device copies also use.

This probe releases ``--release-gib`` of KV through a MemoryManager (a level-1 DISCARD) and then,
for ``--window-s`` seconds, times back-to-back copies of ``--chunk-mib`` each, cycling through:

  op        engine   what it shows
  h2d ce    copy     cudaMemcpyAsync pinned -> device: the wake's own copy
  d2d ce    copy     cudaMemcpyAsync device -> device: HBM through the copy engines
  h2d sm    SMs      a kernel reading the pinned buffer through its device mapping (UVA):
                     host-to-device without the copy engines

The same cycle with no release before it is the baseline. If only the copy-engine rows slow down
after the release, the reclaim uses the copy engines, and a wake could copy with the SMs instead.

Usage: python benchmarks/release_contention.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import GiB, MiB, Recorder, environment, table
from dormant.memory import MemoryManager


def device_view_of_pinned(host: torch.Tensor) -> torch.Tensor | None:
    """A CUDA tensor at the pinned buffer's address (UVA maps pinned memory at the same pointer),
    so that torch's elementwise kernels read it over PCIe; ``None`` without CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    memory = cupy.cuda.UnownedMemory(host.data_ptr(), host.numel(), host, device_id=0)
    array = cupy.ndarray((host.numel() // 4,), cupy.int32, cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device="cuda")


def time_op(op: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    op()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def series(rec: Recorder, label: str, ops: dict[str, Callable[[], object]], nbytes: int,
           window_s: float, t0: float) -> list[dict]:  # fmt: skip
    """Cycles through ``ops`` until ``window_s`` has passed since ``t0``; a row per copy."""
    rows = []
    while (now := time.perf_counter()) - t0 < window_s:
        for name, op in ops.items():
            seconds = time_op(op)
            rows.append(rec.emit(case="copy", series=label, op=name, since_release_s=now - t0,
                                 seconds=seconds, gbps=nbytes / seconds / 1e9))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--release-gib", type=int, default=60)
    parser.add_argument("--chunk-mib", type=int, default=256)
    parser.add_argument("--window-s", type=float, default=0.6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    nbytes = args.chunk_mib * MiB
    host = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    ops: dict[str, Callable[[], object]] = {
        "h2d ce": lambda: dst.copy_(host, non_blocking=True),
        "d2d ce": lambda: dst.copy_(src),
    }
    host_view = device_view_of_pinned(host)
    if host_view is not None:
        dst_words = dst.view(torch.int32)
        ops["h2d sm"] = lambda: torch.bitwise_or(host_view, 0, out=dst_words)
        torch.bitwise_or(host_view, 0, out=dst_words)
        torch.cuda.synchronize()
        rec.emit(case="check", op="h2d sm", is_exact=bool(torch.equal(dst.cpu(), host)))
    for op in ops.values():  # warm up
        time_op(op)

    mm = MemoryManager("cuda")
    kv = mm.empty((args.release_gib * GiB,), torch.uint8, "kv_cache")
    kv.view(-1)[:: 64 * MiB].fill_(1)
    rows = []
    for _ in range(args.repeats):
        time.sleep(1.0)
        rows += series(rec, "no release", ops, nbytes, args.window_s, time.perf_counter())
        report = mm.sleep(tags={"kv_cache": "discard"})
        rows += series(rec, f"after releasing {args.release_gib} GiB", ops, nbytes,
                       args.window_s, time.perf_counter())  # fmt: skip
        rec.emit(case="release", seconds=report.total_s, bytes_released=report.bytes_released)
        mm.wake_up()
    del kv
    mm.close()

    summary = []
    for label in dict.fromkeys(r["series"] for r in rows):
        for name in ops:
            for lo, hi in ((0.0, 0.1), (0.1, 0.25), (0.25, args.window_s)):
                picked = [r["gbps"] for r in rows if r["series"] == label and r["op"] == name
                          and lo <= r["since_release_s"] < hi]  # fmt: skip
                if picked:
                    summary.append(rec.emit(case="summary", series=label, op=name,
                                            window=f"{lo}-{hi} s", n=len(picked),
                                            gbps=statistics.median(picked)))  # fmt: skip
    print(table(summary, ["series", "op", "window", "n", "gbps"]))


if __name__ == "__main__":
    main()
