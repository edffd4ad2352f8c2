"""The sampler's draw at a decode step's batch sizes, on a 151936-token vocabulary (Qwen3's),
float32 logits, on the GPU: the torch reference against the fused Triton kernel.

Rows are sampled at temperature 1.0 without filtering (the RL rollout's parameters), each
variant captured in a CUDA graph and replayed, so the figure is device time. The roofline is
one read of the logits block over the measured device-copy bandwidth (the fused kernel reads it
twice: the row maximum, then the draw). The tokens of both variants are compared too.

Usage: python benchmarks/sampling.py [--batch-sizes 1 64 128 512] [--vocab 151936] [--out f]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table
from benchmarks.decode import device_copy_bandwidth
from benchmarks.logprob_parts import graph_time
from dormant.worker.sampler import SamplingTensors, noise_keys, sample_and_process, sample_reference


def unfiltered(num_rows: int, vocab: int) -> SamplingTensors:
    seeds = torch.arange(num_rows, dtype=torch.int64) * 7919 + 1
    steps = torch.full((num_rows,), 100, dtype=torch.int64)
    return SamplingTensors(
        temperatures=torch.ones(num_rows, device="cuda"),
        top_ks=torch.full((num_rows,), vocab, dtype=torch.int32, device="cuda"),
        top_ps=torch.ones(num_rows, device="cuda"),
        min_ps=torch.zeros(num_rows, device="cuda"),
        seeds=seeds.cuda(),
        steps=steps.cuda(),
        is_greedy=torch.zeros(num_rows, dtype=torch.bool, device="cuda"),
        noise_keys=noise_keys(seeds, steps).cuda(),
        is_all_greedy=False,
        is_any_filtered=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 128, 512])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    bandwidth = device_copy_bandwidth(1 << 30)
    rows = []
    for batch in args.batch_sizes:
        logits = 3 * torch.randn(batch, args.vocab, device="cuda")
        t = unfiltered(batch, args.vocab)
        roofline = logits.numel() * logits.element_size() / bandwidth
        reference = sample_reference(logits, t, keep_processed=False)[0]
        fused = sample_and_process(logits, t, keep_processed=False)[0]
        same = bool(torch.equal(reference, fused))
        variants = {"torch reference": sample_reference, "fused": sample_and_process}
        for variant, draw in variants.items():
            seconds = graph_time(partial(draw, logits, t, False))
            row = dict(variant=variant, batch_size=batch, vocab=args.vocab, seconds=seconds)
            row.update(roofline_s=roofline, x_roofline=seconds / roofline, tokens_equal=same)
            rows.append(rec.emit(case="draw", **row))
    columns = ["variant", "batch_size", "seconds", "roofline_s", "x_roofline", "tokens_equal"]
    print(table(rows, columns))


if __name__ == "__main__":
    main()
