"""What one device-to-device copy of an IPC bucket costs the host, by size and by the memory at
either end, and whether issuing it in chunks lets the device start before the host is done
(issue 13).

The engine's bucket copy is one ``cudaMemcpyAsync`` of 512 MiB; its enqueue takes about 0.09 ms
of host time on the H200's host, whatever issues it (torch's ``copy_`` or the driver's
``cuMemcpyAsync``, the seventeenth session's run 1), and the device starts only once it
returned. Larger buckets did not amortize the host's part as a fixed cost would: in RESULTS.md's
"2026-12-01, third session" (run 5), a bucket's time beyond its copy was about 0.45 ms at 512 MiB
and about 1 ms at 2 GiB (engine side 0.41 / 0.38 x and 0.50 / 0.41 x, reused / new buffer).

Per case (source and destination: plain torch allocations, the engine's ``weights`` pool, a
``MemoryManager`` on the GPU, VMM-mapped; and a buffer another process shares by CUDA IPC, as a
trainer does) it prints the median host time of the enqueue alone per size, and the median time
from the first enqueue to the end of the copy (``torch.cuda.synchronize``) per number of pieces,
over ``--repeats`` copies.

    python benchmarks/copy_enqueue.py [--repeats 30] [--out copy.jsonl]
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
from torch import Tensor
from torch.multiprocessing import reductions

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder
from dormant.memory import WEIGHTS, MemoryManager

BUCKET = 512 * MiB  # what the chunked copies move (issue 13's bucket)
SIZES = (1 * MiB, 16 * MiB, 128 * MiB, 512 * MiB, 2048 * MiB)  # enqueue times, by size
CHUNKS = (1, 2, 4, 8, 16)


def _sharer(conn: Connection) -> None:
    buffer = torch.full((max(SIZES),), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    conn.send(reductions.reduce_tensor(buffer))
    conn.recv()  # keep it alive until the reader is done


def _enqueue_us(dst: Tensor, src: Tensor, nbytes: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst[:nbytes].copy_(src[:nbytes])
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _chunked_us(dst: Tensor, src: Tensor, chunks: int, repeats: int) -> float:
    step = BUCKET // chunks
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for offset in range(0, BUCKET, step):
            dst[offset : offset + step].copy_(src[offset : offset + step])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    recorder = Recorder(args.out)
    memory = MemoryManager("cuda")
    conn, child = get_context("spawn").Pipe()
    sharer = get_context("spawn").Process(target=_sharer, args=(child,))
    sharer.start()
    rebuild, rebuild_args = conn.recv()
    shared = rebuild(*rebuild_args)
    plain = [torch.ones(max(SIZES), dtype=torch.uint8, device="cuda") for _ in range(2)]
    pooled = memory.empty((max(SIZES),), torch.uint8, WEIGHTS)
    cases = {
        "torch -> torch": (plain[0], plain[1]),
        "torch -> pool": (pooled, plain[0]),
        "ipc -> torch": (plain[1], shared),
        "ipc -> pool": (pooled, shared),
    }
    for case, (dst, src) in cases.items():
        _chunked_us(dst, src, 1, 3)  # warm
        for nbytes in SIZES:
            us = _enqueue_us(dst, src, nbytes, args.repeats)
            recorder.emit(case="enqueue", copy=case, mib=nbytes // MiB, host_us=us)
        for chunks in CHUNKS:
            us = _chunked_us(dst, src, chunks, args.repeats)
            recorder.emit(case="chunked", copy=case, chunks=chunks, until_done_us=us)
    del shared, pooled, cases
    conn.send("done")
    sharer.join()
    memory.close()


if __name__ == "__main__":
    main()
