"""What a large release slows down, and for how long (issue 17, the engine's wake right after a
sleep).

``wake_after_release.py`` (results/2026-12-02d-run2-wake_after_release.jsonl) showed that a
level-1 wake of 16 GiB of weights that starts right after a sleep released 60-75 GB of KV runs at
1.5 x the pinned-copy limit, and at 1.07 x once 0.25 s have passed since that release, whatever
the weights did. Hypothesis: the driver reclaims (scrubs) the released memory for a fraction of a
second after ``cuMemRelease`` returns, with the copy engines that host-to-device copies also use.

This probe releases ``--release-gib`` of KV through a MemoryManager (a level-1 DISCARD) and then,
for ``--window-s`` seconds, times back-to-back copies of ``--chunk-mib`` each, cycling through:

  op          engine   what it shows
  h2d ce      copy     cudaMemcpyAsync pinned -> device: the wake's own copy
  d2d ce      copy     cudaMemcpyAsync device -> device: HBM through the copy engines
  h2d sm      SMs      dormant.memory.sm_copy: kernels reading the pinned buffer through its
                       device mapping: host-to-device without the copy engines
  h2d hybrid  both     half the bytes by h2d ce on one stream, half by h2d sm on another,
                       concurrently (the wake's CopyPath.HYBRID at sm_fraction 0.5)
  d2h ce      copy     cudaMemcpyAsync device -> pinned (a sleep's copy)
  d2h sm      SMs      sm_copy writing the pinned buffer through its device mapping

The same cycle with no release before it is the baseline. If only the copy-engine rows slow down
after the release, the reclaim uses the copy engines, and a wake could copy with the SMs instead;
if h2d hybrid beats both h2d rows, both together use the link better than either alone.
(2026-12-02d run 3 had only the first three, its h2d sm a CuPy view of the buffer.)

Usage: python benchmarks/release_contention.py [--out results.jsonl] [--ops "h2d ce,h2d sm"]
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
from dormant.memory import DriverError, MemoryManager
from dormant.memory.cuda_driver import call
from dormant.memory.sm_copy import sm_copy

OPS = ("h2d ce", "d2d ce", "h2d sm", "h2d hybrid", "d2h ce", "d2h sm")


def device_address(host: torch.Tensor) -> int:
    """The device address of torch's pinned buffer: the driver's answer, or under unified
    addressing the host pointer itself (memory from cudaHostAlloc is always mapped there)."""
    try:
        return int(call("cuMemHostGetDevicePointer", host.data_ptr(), 0))
    except DriverError:
        return host.data_ptr()


def copy_ops(host: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> dict[str, Callable]:
    """Every op of the docstring's table, each on torch's current stream (so CUDA events time
    it); ``host`` is pinned, ``dst`` and ``src`` are device buffers of the same size."""
    nbytes, device = host.numel(), dst.device
    host_address = device_address(host)
    half = nbytes // 2
    side = [torch.cuda.Stream(), torch.cuda.Stream()]

    def hybrid() -> None:
        main = torch.cuda.current_stream()
        for stream in side:
            stream.wait_stream(main)
        with torch.cuda.stream(side[0]):
            dst[:half].copy_(host[:half], non_blocking=True)
        with torch.cuda.stream(side[1]):
            sm_copy(dst.data_ptr() + half, host_address + half, nbytes - half, device)
        for stream in side:
            main.wait_stream(stream)

    return {
        "h2d ce": lambda: dst.copy_(host, non_blocking=True),
        "d2d ce": lambda: dst.copy_(src),
        "h2d sm": lambda: sm_copy(dst.data_ptr(), host_address, nbytes, device),
        "h2d hybrid": hybrid,
        "d2h ce": lambda: host.copy_(src, non_blocking=True),
        "d2h sm": lambda: sm_copy(host_address, src.data_ptr(), nbytes, device),
    }


def check_exact(rec: Recorder, ops: dict[str, Callable], host: torch.Tensor, dst: torch.Tensor,
                src: torch.Tensor) -> None:  # fmt: skip
    """One row per op: whether its copy landed bit-exact."""
    expected_h2d, expected_d2h = host.clone(), src.cpu()
    for name, op in ops.items():
        if name == "d2d ce":
            continue
        dst.zero_()
        host.copy_(expected_h2d)
        op()
        torch.cuda.synchronize()
        got, want = (dst.cpu(), expected_h2d) if name.startswith("h2d") else (host, expected_d2h)
        rec.emit(case="check", op=name, is_exact=bool(torch.equal(got, want)))
    host.copy_(expected_h2d)


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
    parser.add_argument("--ops", default=",".join(OPS), help=f"a subset of {', '.join(OPS)}")
    args = parser.parse_args()
    names = [name.strip() for name in args.ops.split(",")]
    if unknown := sorted(set(names) - set(OPS)):
        parser.error(f"unknown ops {unknown}; use some of {', '.join(OPS)}")
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    mm = MemoryManager("cuda")  # first: its backend makes the driver's context current here
    nbytes = args.chunk_mib * MiB
    host = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    ops = {name: op for name, op in copy_ops(host, dst, src).items() if name in names}
    check_exact(rec, ops, host, dst, src)
    for op in ops.values():  # warm up
        time_op(op)

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
