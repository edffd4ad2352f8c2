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
    offset by a   the two streams in lockstep, the second half one phase behind the first:
    phase         one's attention part of a layer beside the other's feed-forward part (the
                  schedule of a two-batch overlap step)

    typed streams the same lockstep, but each phase on the stream of its kind: the feed-forward
                  phases (GEMMs, compute-bound) on a high-priority stream, the attention ones
                  on a low-priority stream, so the GEMMs' blocks are dispatched first and the
                  attention fills the SMs they leave

``--carveouts``: the two-stream ways again with the GEMMs held to fewer SMs (cuBLASLt's SM count
target, torch's ``_set_sm_carveout_experimental``: that many SMs left to the other stream), each
with its own "halves" reference (the carveout changes the GEMMs' algorithms, so their bits).
Without scheduling the SMs, the engine's GEMMs (persistent kernels) take every SM, so a kernel
on the other stream starts only as their last blocks drain (2026-12-05 run 2: two free streams
5-7 % under the halves, 7-8 % over the whole batch at batch 512 on an H100).

The halves read the same weights, as a two-batch step would. Per batch size and way it prints the
median milliseconds per layer, that over the whole batch's memory roofline (its weights once and
all of its KV, at the measured copy bandwidth), and its time over the halves' (below 1 for a
two-stream way: the streams overlapped). The two-stream replays' outputs must equal the halves'
bit for bit (the same kernels on the same inputs).

    python benchmarks/overlap_probe.py [--batch-sizes 512,256] [--context 768]
        [--carveouts 24,48] [--out o.jsonl]
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


def offset_by_a_phase(first: DenseLayerChain, second: DenseLayerChain) -> Run:
    """The two halves on two streams in lockstep, the second one phase behind: while the first
    runs a layer's attention part (``attend``) the second runs the layer before's feed-forward
    part, and the other way round. After each phase both streams wait for each other."""
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    chains = (first, second)
    num_phases = 2 * first.num_layers

    def phase(chain: DenseLayerChain, state: list[torch.Tensor], index: int) -> torch.Tensor:
        layer, part = divmod(index, 2)
        if part == 0:
            state[0], state[1] = chain.attend(layer, state[0], state[1], chain.default)
        else:
            state[0], state[1] = chain.feed_forward(layer, state[0], state[1], chain.default)
        return state[0]

    def run() -> list[torch.Tensor]:
        main = torch.cuda.current_stream()
        states = [[chain.hidden, chain.residual] for chain in chains]
        outputs: list[list[torch.Tensor]] = [[], []]
        for stream in streams:
            stream.wait_stream(main)
        for tick in range(num_phases + 1):
            for half, (stream, chain) in enumerate(zip(streams, chains, strict=True)):
                index = tick - half
                if 0 <= index < num_phases:
                    with torch.cuda.stream(stream):
                        outputs[half].append(phase(chain, states[half], index))
            streams[0].wait_stream(streams[1])
            streams[1].wait_stream(streams[0])
        for stream in streams:
            main.wait_stream(stream)
        return outputs[0] + outputs[1]

    return run


def typed_streams(first: DenseLayerChain, second: DenseLayerChain) -> Run:
    """``offset_by_a_phase``, each phase on the stream of its kind: feed-forward phases on a
    high-priority stream, attention phases on a low-priority one (at each tick the two halves
    run one of each; both streams wait for each other after it, so each half's order holds)."""
    # 0 is the lowest priority; a number below the range is mapped to the highest.
    attention_stream, ffn_stream = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-99)
    chains = (first, second)
    num_phases = 2 * first.num_layers

    def run() -> list[torch.Tensor]:
        main = torch.cuda.current_stream()
        states = [[chain.hidden, chain.residual] for chain in chains]
        outputs: list[list[torch.Tensor]] = [[], []]
        # A half's residual is made on one stream and read on the other; freed when the next
        # phase replaces it, its block would go back to the stream that made it while the
        # other stream may still read it (the other half's phase in the same tick could be
        # handed it). Kept until the end of the run instead.
        residuals: list[torch.Tensor] = []
        for stream in (attention_stream, ffn_stream):
            stream.wait_stream(main)
        for tick in range(num_phases + 1):
            for half, chain in enumerate(chains):
                index = tick - half
                if not 0 <= index < num_phases:
                    continue
                layer, part = divmod(index, 2)
                state = states[half]
                with torch.cuda.stream(ffn_stream if part else attention_stream):
                    step = chain.feed_forward if part else chain.attend
                    state[0], state[1] = step(layer, state[0], state[1], chain.default)
                outputs[half].append(state[0])
                residuals.append(state[1])
            attention_stream.wait_stream(ffn_stream)
            ffn_stream.wait_stream(attention_stream)
        for stream in (attention_stream, ffn_stream):
            main.wait_stream(stream)
        return outputs[0] + outputs[1]

    return run


WAYS: dict[str, Callable[[DenseLayerChain, DenseLayerChain], Run]] = {
    "halves": in_series,
    "two streams": on_two_streams,
    "offset by a phase": offset_by_a_phase,
    "typed streams": typed_streams,
}


def set_carveout(sms: int | None) -> None:
    """GEMMs held to all but ``sms`` SMs (None: all of them, cuBLAS as by default)."""
    torch._C._set_sm_carveout_experimental(sms)
    torch.backends.cuda.preferred_blas_library("cublaslt" if sms else "cublas")


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
    parser.add_argument("--carveouts", default="", help="SMs left by the GEMMs, e.g. 24,48")
    parser.add_argument("--out", default=None, help="JSON lines are appended here too")
    args = parser.parse_args()
    words = [c for c in args.carveouts.split(",") if c]
    if not all(c.isdigit() and 0 < int(c) < 132 for c in words):
        parser.error(f"--carveouts takes SM counts from 1 to 131, got {args.carveouts!r}")
    carveouts: list[int | None] = [None, *map(int, words)]
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
        for carveout in carveouts:
            set_carveout(carveout)
            ways, outputs = ({"one batch": times} if carveout is None else {}), {}
            for way, make in WAYS.items():
                ways[way], outputs[way] = timed(make(first, second), first.num_layers)
            set_carveout(None)
            expected = outputs["halves"]
            equal = {
                way: all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
                for way, got in outputs.items()
                if way != "halves"
            }
            halves_ms, whole_ms = statistics.median(ways["halves"]), statistics.median(times)
            for way, values in ways.items():
                median = statistics.median(values)
                rows.append(rec.emit(
                    case="overlap probe", batch=batch, way=way, carveout=carveout,
                    per_layer_ms=median, min_ms=min(values), max_ms=max(values),
                    roofline_ms=roofline_ms, x_roofline=median / roofline_ms,
                    over_halves=median / halves_ms, over_one_batch=median / whole_ms,
                    bit_exact=equal.get(way),
                ))  # fmt: skip
            del expected, outputs
        del first, second
        torch.cuda.empty_cache()
    columns = ["batch", "way", "carveout", "per_layer_ms", "x_roofline", "over_halves",
               "over_one_batch", "bit_exact"]  # fmt: skip
    print(table(rows, columns))


if __name__ == "__main__":
    main()
