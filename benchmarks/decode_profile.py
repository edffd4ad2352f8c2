"""Where a batch-1 decode step of the 8B-like model spends its GPU time: kernels by name.

Profiles the eager step (every kernel launched from Python) and the graph replay, with
``torch.profiler``, and records per kernel name: calls per step and GPU time per step; and per
step: kernel count, the sum of kernel times, and the wall time. Run it twice, with and without
``DORMANT_TRITON=0``, to compare the fused Triton kernels with the torch reference.

Usage: python benchmarks/decode_profile.py [--out results.jsonl] [--top 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table
from benchmarks.decode import QWEN3_8B_LIKE, decode_step
from dormant import LLM
from dormant.layers.kernels import IS_TRITON_ENABLED
from dormant.models import ModelConfig

NUM_STEPS = 5


def kernel_times(run, num_steps: int) -> tuple[dict[str, list[float]], float]:
    """Per kernel name: [calls, total GPU seconds] over ``num_steps`` runs; and the wall time
    per run."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / num_steps
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name[:80]
        kernels[name][0] += 1
        kernels[name][1] += event.device_time_total / 1e6  # microseconds → seconds
    return kernels, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", triton_kernels=IS_TRITON_ENABLED, **environment())
    llm = LLM(ModelConfig.from_dict(QWEN3_8B_LIKE), max_model_len=4096, max_num_seqs=64,
              gpu_memory_utilization=0.6)  # fmt: skip
    worker = llm.llm_engine.executor.worker
    runner = worker.runner
    block_size = llm.llm_engine.config.block_size
    step = decode_step(1, 512, block_size, 4096 // block_size)

    def eager() -> None:
        with torch.inference_mode():
            runner._eager(step)

    def graph() -> None:
        worker.execute(step)

    for mode, run in (("eager", eager), ("graph", graph)):
        kernels, wall = kernel_times(run, NUM_STEPS)
        total = sum(seconds for _, seconds in kernels.values()) / NUM_STEPS
        count = sum(calls for calls, _ in kernels.values()) / NUM_STEPS
        rec.emit(case="step", mode=mode, kernels_per_step=count, kernel_s=total, wall_s=wall)
        ranked = sorted(kernels.items(), key=lambda item: -item[1][1])[: args.top]
        rows = [
            rec.emit(case="kernel", mode=mode, name=name, calls_per_step=calls / NUM_STEPS,
                     s_per_step=seconds / NUM_STEPS, share=seconds / NUM_STEPS / total)
            for name, (calls, seconds) in ranked
        ]  # fmt: skip
        print(table(rows, ["name", "calls_per_step", "s_per_step", "share"]))
    llm.shutdown()


if __name__ == "__main__":
    main()
