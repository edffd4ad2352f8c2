"""Where the cost of logprobs goes, part by part, on a batch-64 row block of a 151936-token
vocabulary (Qwen3's), float32 logits, on the GPU.

Each device variant is captured in a CUDA graph and replayed, so the figure is device time
without launch overhead (in a decode step the host is ahead of the device). The host part,
turning the packed rows into ``TokenLogprobs``, is timed on its own.

Usage: python benchmarks/logprob_parts.py [--out results.jsonl] [--batch 64] [--vocab 151936]
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

from benchmarks.common import Recorder, environment, table
from dormant.worker.logprobs import gather_logprobs, packed_logprobs, unpack_logprobs


def graph_time(fn: Callable[[], object], replays: int = 200) -> float:
    """Median device seconds of one ``fn()``, replayed from a CUDA graph in groups of 20."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    samples = []
    for _ in range(replays // 20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / 20)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    logits = 3 * torch.randn(args.batch, args.vocab, device="cuda")
    tokens = logits.argmax(-1)
    nbytes = logits.numel() * logits.element_size()
    parts: dict[str, Callable[[], object]] = {
        "read once (amax)": lambda: logits.amax(-1),
        "log_softmax": lambda: logits.log_softmax(-1),
        "rank (compare + sum)": lambda: (logits > logits.gather(-1, tokens[:, None])).sum(-1),
        "topk 5": lambda: logits.topk(5, dim=-1),
        "argmax": lambda: logits.argmax(-1),
    }
    for k in (0, 5):
        parts[f"reference, logprobs={k}"] = lambda k=k: gather_logprobs(
            logits.log_softmax(-1), tokens, k
        )
        parts[f"fused, logprobs={k}"] = lambda k=k: packed_logprobs(
            logits, tokens, k, "raw_logprobs"
        )
    rows = []
    for name, fn in parts.items():
        seconds = graph_time(fn)
        rows.append(
            rec.emit(case="device", part=name, us=seconds * 1e6, gbps=nbytes / seconds / 1e9)
        )
    for k in (0, 5):
        packed = packed_logprobs(logits, tokens, k, "raw_logprobs").cpu().numpy()
        samples = []
        for _ in range(200):
            start = time.perf_counter()
            unpack_logprobs(packed)
            samples.append(time.perf_counter() - start)
        rows.append(
            rec.emit(case="host", part=f"unpack, logprobs={k}", us=statistics.median(samples) * 1e6)
        )
    print(table(rows, ["case", "part", "us", "gbps"]))


if __name__ == "__main__":
    main()
