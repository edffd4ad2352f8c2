"""Decode speed of an 8B-like model (random weights) with CUDA graphs, and the engine's own
sleep/wake timings per tag.

- batch-1 decode step against the HBM roofline (weight bytes / measured device copy bandwidth),
  target <= 1.5x; throughput at batch 1, 8 and 64;
- the first decode after a wake against steady state (graphs are not recaptured);
- per-tag sleep (level 1) and wake timings of the engine, against the pinned-copy limit.

Usage: python benchmarks/decode.py [--out results.jsonl]
(``DORMANT_TRITON=0`` runs every layer's torch reference instead of the Triton kernels.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import GiB, Recorder, environment, table
from dormant import LLM, SamplingParams
from dormant.core.step_input import SeqInput, StepInput
from dormant.layers.kernels import IS_TRITON_ENABLED
from dormant.models import ModelConfig

QWEN3_8B_LIKE = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": 151645,
}  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def device_copy_bandwidth(nbytes: int = 8 * GiB) -> float:
    """Bytes read plus bytes written per second by a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:])


def matmul_flops_per_s(size: int = 8192) -> float:
    """The device's bf16 GEMM rate: a ``size``-cubed matmul, median of five after a warm-up."""
    a = torch.randn((size, size), dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times[1:])


def decode_step(
    batch_size: int,
    context: int,
    block_size: int,
    num_kv_blocks: int,
    params: SamplingParams = GREEDY,
    num_steps: int = 1,
) -> StepInput:
    """A decode step of ``batch_size`` sequences at position ``context``, sampled with
    ``params`` (greedy by default), each with its own blocks: the ones its next ``num_steps``
    positions need (``num_steps`` > 1: a fused multi-step call's), of the ``num_kv_blocks``
    the engine's KV cache holds (``llm.llm_engine.runtime.num_kv_blocks``). A block id beyond
    the cache would be an illegal address in the attention kernels, so a step that does not
    fit raises instead."""
    per_seq = -(-(context + num_steps) // block_size)
    if batch_size * per_seq > num_kv_blocks:
        raise ValueError(
            f"{batch_size} sequences at context {context} need {batch_size * per_seq} KV blocks"
            f" of {block_size} tokens; the cache has {num_kv_blocks}"
        )
    seqs = []
    for i in range(batch_size):
        table = tuple(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(SeqInput((11,), context, table, params, seed=i, num_output_tokens=1))
    return StepInput(tuple(seqs), is_prefill=False)


def time_steps(run, step: StepInput, repeats: int = 30) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(step)  # ends with the sampled tokens on the host: a full step
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", triton_kernels=IS_TRITON_ENABLED, **environment())
    bandwidth = device_copy_bandwidth()
    config = ModelConfig.from_dict(QWEN3_8B_LIKE)
    start = time.perf_counter()
    llm = LLM(config, max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.6)
    worker = llm.llm_engine.executor.worker
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    roofline = weight_bytes / bandwidth
    rec.emit(
        case="setup",
        load_and_capture_s=time.perf_counter() - start,
        weight_bytes=weight_bytes,
        d2d_bytes_per_s=bandwidth,
        roofline_s=roofline,
    )

    block_size = llm.llm_engine.config.block_size
    num_kv_blocks = llm.llm_engine.runtime.num_kv_blocks
    rows = []
    for batch_size in (1, 8, 64):
        step = decode_step(batch_size, 512, block_size, num_kv_blocks)
        times = time_steps(worker.execute, step)
        median = statistics.median(times[3:])
        row = rec.emit(
            case="decode",
            batch_size=batch_size,
            step_s=median,
            min_s=min(times),
            max_s=max(times),
            tokens_per_s=batch_size / median,
            x_roofline=median / roofline,
        )
        rows.append(row)
    step = decode_step(1, 512, block_size, num_kv_blocks)
    multi = statistics.median(time_steps(worker.execute_multi_step, step)[3:])
    steps = llm.llm_engine.config.cuda_graph_multi_steps
    rows.append(
        rec.emit(
            case="decode multi-step",
            batch_size=1,
            step_s=multi / steps,
            tokens_per_s=steps / multi,
            x_roofline=multi / steps / roofline,
        )
    )

    steady_steps = time_steps(worker.execute, step)[3:]
    steady = statistics.median(steady_steps)
    rec.emit(case="steady", batch_size=1, step_s=steady, max_s=max(steady_steps))
    for level in (1, 2, 1, 2, 1, 2):  # the first level-1 sleep also sets up the host arena
        llm.sleep(level=level)
        sleep = llm.memory_status()[0].last_sleep
        llm.wake_up(["weights"])
        weights = llm.memory_status()[0].last_wake
        if level == 2:
            llm.reload_weights()
        llm.wake_up(["kv_cache"])
        kv = llm.memory_status()[0].last_wake
        first, second = time_steps(worker.execute, step, repeats=2)
        rows.append(
            rec.emit(
                case=f"after level-{level} wake",
                batch_size=1,
                step_s=first,
                second_step_s=second,
                x_steady=first / steady,
                sleep_s=sleep.total_s,
                sleep_copied=sleep.bytes_copied,
                sleep_released=sleep.bytes_released,
                wake_weights_s=weights.total_s,
                wake_weights_copied=weights.bytes_copied,
                wake_kv_s=kv.total_s,
                wake_kv_map_s=kv.map_s,
                wake_kv_copy_s=kv.copy_s,
                wake_kv_mapped=kv.bytes_mapped,
                wake_kv_copied=kv.bytes_copied,
            )
        )
    print(llm.memory_status()[0].table())
    llm.shutdown()
    print(
        table(
            rows,
            [
                "case",
                "batch_size",
                "step_s",
                "tokens_per_s",
                "x_roofline",
                "x_steady",
                "sleep_s",
                "wake_weights_s",
                "wake_kv_s",
            ],
        )
    )


if __name__ == "__main__":
    main()
