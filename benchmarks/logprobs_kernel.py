"""The fused logprobs kernel's shape sweep: ``fused_logprobs`` on ``[n, 151936]`` float32 logits.

The sampled 4-step graph at batch 512 spent 0.89 ms per step in ``_segment_stats_kernel``
(``2026-12-02-run1-profile-b512-ms4``), reading 311 MB: 0.35 TB/s, a twelfth of the copy
bandwidth. This times the kernel pair (CUDA events, median of 50 after a warm-up) at rows
``n`` and ``num_top`` over the first kernel's ``segment`` and ``num_warps``, with the bandwidth
each reaches (the logits' bytes over the time) against a device-to-device copy measured in the
same run, and checks each shape's packed rows equal the default shape's (the values may differ
in the last place: the order of a float32 sum).

Usage: python benchmarks/logprobs_kernel.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table
from benchmarks.decode import device_copy_bandwidth
from dormant.layers.triton_logprobs import fused_logprobs
from dormant.worker.logprobs import packed_width

VOCAB = 151936
SEGMENTS = (2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)


def kernel_seconds(run, repeats: int = 50) -> float:
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    bandwidth = device_copy_bandwidth()
    rec.emit(case="copy", bytes_per_s=bandwidth)
    rows = []
    for num_rows in (128, 512):
        logits = torch.randn((num_rows, VOCAB), device="cuda") * 3
        tokens = torch.randint(0, VOCAB, (num_rows,), device="cuda")
        for num_top in (0, 5):
            expected = torch.empty((num_rows, packed_width(num_top)), dtype=torch.int32,
                                   device="cuda")  # fmt: skip
            fused_logprobs(logits, tokens, num_top, expected)
            for segment in SEGMENTS:
                for warps in WARPS:
                    if segment // (32 * warps) < 4:  # fewer than 4 values per thread
                        continue
                    packed = torch.empty_like(expected)
                    run = partial(
                        fused_logprobs, logits, tokens, num_top, packed, segment=segment,
                        num_warps=warps,
                    )  # fmt: skip
                    seconds = kernel_seconds(run)
                    same = bool(torch.equal(packed[:, :2], expected[:, :2]))
                    rows.append(rec.emit(
                        case="kernel", rows=num_rows, num_top=num_top, segment=segment,
                        num_warps=warps, seconds=seconds,
                        x_copy=logits.numel() * 4 / seconds / bandwidth,
                        tokens_and_ranks_equal=same,
                    ))  # fmt: skip
    print(table(rows, ["rows", "num_top", "segment", "num_warps", "seconds", "x_copy",
                       "tokens_and_ranks_equal"]))  # fmt: skip


if __name__ == "__main__":
    main()
