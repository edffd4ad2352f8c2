"""Where a decode step spends its GPU time: kernels by name.

The 8B-like dense model at batch 1 and context 512 by default; ``--model moe`` takes the
Qwen3-30B-A3B-sized MoE of ``benchmarks/moe.py`` (``--layers`` of it), ``--batch-size`` and
``--context`` the rollout's shapes. ``--multi-steps N --sampled`` profiles the rollout's decode
call instead of the greedy step: the fused ``N``-step graph's replay of rows sampled at
temperature 1 with ``logprobs=0`` (the sampler's and logprobs' kernels, and the host's work
around the replay: the wall time against the kernels' sum), figures per call and per step.

Profiles the eager step (every kernel launched from Python) and the graph replay, with
``torch.profiler``, and records per kernel name: calls per step and GPU time per step; and per
step: kernel count, the sum of kernel times, and the wall time. Run it twice, with and without
``DORMANT_TRITON=0``, to compare the fused Triton kernels with the torch reference.

Usage: python benchmarks/decode_profile.py [--out results.jsonl] [--top 15] [--model moe]
       [--layers N] [--batch-size B] [--context C] [--multi-steps N] [--sampled]
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
from benchmarks.decode import GREEDY, QWEN3_8B_LIKE, decode_step
from benchmarks.moe import QWEN3_30B_A3B
from benchmarks.moe_roofline import fill_kv_cache
from dormant import LLM, SamplingParams
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
    parser.add_argument("--model", choices=("dense", "moe"), default="dense")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (the model's)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--multi-steps", type=int, default=1, help="steps per graph replay")
    parser.add_argument("--sampled", action="store_true", help="temperature 1, logprobs=0")
    args = parser.parse_args()
    num_steps = args.multi_steps
    rec = Recorder(args.out)
    rec.emit(case="environment", triton_kernels=IS_TRITON_ENABLED, model=args.model,
             batch_size=args.batch_size, context=args.context, multi_steps=num_steps,
             sampled=args.sampled, **environment())  # fmt: skip
    shape = QWEN3_8B_LIKE if args.model == "dense" else QWEN3_30B_A3B
    if args.layers is not None:
        shape = {**shape, "num_hidden_layers": args.layers}
    max_model_len = max(4096, 2 * args.context)
    llm = LLM(ModelConfig.from_dict(shape), max_model_len=max_model_len,
              max_num_seqs=max(64, args.batch_size), cuda_graph_batch_sizes=(args.batch_size,),
              cuda_graph_multi_steps=num_steps, gpu_memory_utilization=0.8)  # fmt: skip
    worker = llm.llm_engine.executor.worker
    runner = worker.runner
    block_size = llm.llm_engine.config.block_size
    params = SamplingParams(temperature=1.0, logprobs=0) if args.sampled else GREEDY
    step = decode_step(
        args.batch_size, args.context, block_size, llm.llm_engine.runtime.num_kv_blocks,
        params, num_steps,
    )  # fmt: skip
    if args.model == "moe":
        fill_kv_cache(worker.model)  # finite keys and values: the routing sees real activations

    def eager() -> None:
        with torch.inference_mode():
            runner._eager(step)

    def graph() -> None:
        if num_steps > 1:
            worker.execute_multi_step(step)
        else:
            worker.execute(step)

    for mode, run in (("eager", eager), ("graph", graph)):
        kernels, wall = kernel_times(run, NUM_STEPS)
        total = sum(seconds for _, seconds in kernels.values()) / NUM_STEPS
        count = sum(calls for calls, _ in kernels.values()) / NUM_STEPS
        steps = num_steps if mode == "graph" else 1  # a multi-step call runs num_steps
        rec.emit(case="step", mode=mode, steps_per_call=steps, kernels_per_step=count / steps,
                 kernel_s=total / steps, wall_s=wall / steps)  # fmt: skip
        ranked = sorted(kernels.items(), key=lambda item: -item[1][1])[: args.top]
        rows = [
            rec.emit(case="kernel", mode=mode, name=name,
                     calls_per_step=calls / NUM_STEPS / steps,
                     s_per_step=seconds / NUM_STEPS / steps, share=seconds / NUM_STEPS / total)
            for name, (calls, seconds) in ranked
        ]  # fmt: skip
        print(table(rows, ["name", "calls_per_step", "s_per_step", "share"]))
    llm.shutdown()


if __name__ == "__main__":
    main()
