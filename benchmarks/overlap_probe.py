"""Whether two half-batches on two streams let a decode step's compute-bound GEMMs run beside its
bandwidth-bound attention on the H200 (issue 16, before building it into the engine).

The rollout's batch-512 step without prefix caching reads 58 GB of KV in its attention, at the
copy bandwidth (14.1 ms), and runs 7.8 TFLOP of GEMMs (9.9 ms), one after the other: 1.54-1.63 x
the memory roofline, which counts the bytes alone. Only running the two at once could bring it
under 1.4 x. This probe measures what the hardware gives for that without any scheduling of SMs:
NUM_LAYERS dense decoder layers of Qwen3-8B's shapes (``dense_decode_sweep.DenseLayerChain``:
the Triton layer the engine launches, every sequence at ``--context``), each way captured as one
CUDA graph:

    way           what runs
    ────────────  ──────────────────────────────────────────────────────────────────────────
    one batch     the whole batch in one chain of layers (what the engine runs today)
    halves        two chains of half the batch each, one after the other on one stream
    two streams   the same two chains on two streams forked from the capture stream and
                  joined at the end: each half's layers in order, the halves independent

The halves read the same weights, as a two-batch step would. Per batch size and way it prints the
median milliseconds per layer, that over the whole batch's memory roofline (its weights once and
all of its KV, at the measured copy bandwidth), and for "two streams" its time over the halves'
(below 1: the streams overlapped). The two-stream replay's outputs must equal the halves' bit for
bit (the same kernels on the same inputs).

    python benchmarks/overlap_probe.py [--batch-sizes 512,256] [--context 768] [--out o.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table
from benchmarks.dense_decode_sweep import DenseLayerChain

Run = Callable[[], list[torch.Tensor]]
SHARED = ("w_qkv", "w_o", "w_up", "w_down", "norms", "qk_norms")


def halves_of(batch: int, context: int) -> tuple[DenseLayerChain, DenseLayerChain]:
    first = DenseLayerChain(batch // 2, context)
    second = DenseLayerChain(batch - batch // 2, context)
    for name in SHARED:  # one set of weights, as one model's two half-batches read
        setattr(second, name, getattr(first, name))
    torch.cuda.empty_cache()
    return first, second


def in_series(first: DenseLayerChain, second: DenseLayerChain) -> Run:
    return lambda: first.run(first.default) + second.run(second.default)


def on_two_streams(first: DenseLayerChain, second: DenseLayerChain) -> Run:
    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def run() -> list[torch.Tensor]:
        main = torch.cuda.current_stream()
        outputs: list[torch.Tensor] = []
        for stream, chain in zip(streams, (first, second), strict=True):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                outputs += chain.run(chain.default)
        for stream in streams:
            main.wait_stream(stream)
        return outputs

    return run


def timed(run: Run, num_layers: int) -> tuple[list[float], list[torch.Tensor]]:
    """Milliseconds per layer of the captured ``run``'s replays, and its outputs (after one
    more replay)."""
    from benchmarks.moe_b1_sweep import capture, replay_per_layer

    graph, outputs = capture(run)
    times = replay_per_layer(graph, num_layers)
    graph.replay()
    torch.cuda.synchronize()
    kept = [o.clone() for o in outputs]
    del graph
    return [t * 1e3 for t in times], kept


def main() -> None:
    from benchmarks.decode import device_copy_bandwidth

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="512,256")
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--out", default=None, help="JSON lines are appended here too")
    args = parser.parse_args()
    rec = Recorder(args.out)
    bandwidth = device_copy_bandwidth()
    rec.emit(case="environment", copy_bandwidth=bandwidth, **environment())
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        whole = DenseLayerChain(batch, args.context)
        roofline_ms = whole.roofline_s(bandwidth) * 1e3
        times, _ = timed(lambda chain=whole: chain.run(chain.default), whole.num_layers)
        del whole
        torch.cuda.empty_cache()
        first, second = halves_of(batch, args.context)
        ways = {"one batch": times}
        ways["halves"], expected = timed(in_series(first, second), first.num_layers)
        ways["two streams"], outputs = timed(on_two_streams(first, second), first.num_layers)
        is_equal = all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
        halves_ms = statistics.median(ways["halves"])
        for way, values in ways.items():
            median = statistics.median(values)
            rows.append(rec.emit(
                case="overlap probe", batch=batch, way=way, per_layer_ms=median,
                min_ms=min(values), max_ms=max(values), roofline_ms=roofline_ms,
                x_roofline=median / roofline_ms, over_halves=median / halves_ms,
                bit_exact=is_equal if way == "two streams" else None,
            ))  # fmt: skip
        del first, second, expected, outputs
        torch.cuda.empty_cache()
    columns = ["batch", "way", "per_layer_ms", "x_roofline", "over_halves", "bit_exact"]
    print(table(rows, columns))


if __name__ == "__main__":
    main()
