"""A Qwen3-30B-A3B-sized MoE (random bf16 weights, about 61 GB at 48 layers) on one GPU.

- decode at batch 1 and 64 with CUDA graphs (the fused Triton MoE kernels), against a roofline
  of the bytes a step actually reads: the experts its tokens routed to (counted per layer from
  the routing of that very step), attention, router, norms, LM head, and the KV read; over the
  measured HBM bandwidth (a device-to-device copy, bytes read + written per second). Target:
  batch 1 within 2x;
- a level-1 sleep and wake of the whole model against the pinned-copy limit (the first one
  also sets up the host arena: its own line);
- a level-2 sleep, then a refit from GPU tensors of this process by the HF per-expert names
  (``update_weights``), against a device-to-device copy of the same bytes;
- the experts of all layers alone, replayed from one graph (``benchmarks/moe_kernels.py``):
  the sorted path against the direct one per batch size, and per tile configuration;
- the routers of all layers alone, the same way (``benchmarks/moe_router.py``): cuBLAS's GEMV +
  ``topk_softmax`` against the fused router, per batch size up to 4, and per tile;
- the attention projections of all layers alone (``benchmarks/moe_gemv.py``): cuBLAS against
  the skinny GEMV, QKV and O, per batch size up to 4, and per tile;
- the old step: decode at batch 1 and 64 with the sorted MoE path at every size (what
  ``fused_experts`` ran before the direct path), in a child process of the same run;
- the step before the batch-1 launch choices of the tenth session: decode at batch 1 and 64
  with the loop down kernel and plain launches (no programmatic dependent launch) in the
  experts, the router and the decode attention, in a child process of the same run;
- the step with every batch-1 launch knob of the eleventh session on (off by default until
  measured): PDL in the norms, the rotary kernel and the KV write, and the PDL GEMV for the
  attention projections, decode at batch 1 and 64, in a child process of the same run;
- the step before the fused router and the skinny GEMV: decode at batch 1 and 64 with the
  router's GEMM and ``topk_softmax``, and cuBLAS's attention projections, at every size, in a
  child process of the same run;
- the step with the fifteenth session's batch-1 tiles (the "tile" experts, the PDL GEMV at
  16 / 8 rows a program), decode at batch 1 and 64, in a child process of the same run;
- the peer: the torch reference path (``DORMANT_TRITON=0``, every expert on every token, FULL
  graphs) at batch 1 and 64, in a child process of the same run.

Usage: python benchmarks/moe.py [--out results.jsonl] [--layers 48] [--skip-peer]
[--skip-sorted] [--skip-unfused] [--skip-plain] [--skip-knobs-off] [--skip-fifteenth]
[--skip-kernels] (about 7-8 minutes on an H200 at 48 layers; ``--layers 8`` for a quick look).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import GiB, Recorder, environment, table
from benchmarks.decode import device_copy_bandwidth
from benchmarks.moe_roofline import (
    count_routed_experts,
    decode_step,
    fill_kv_cache,
    step_bytes,
    time_steps,
)
from dormant import LLM
from dormant.layers.kernels import IS_TRITON_ENABLED
from dormant.models import ModelConfig

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": 151645, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
}  # fmt: skip
BATCH_SIZES = (1, 64)
MAX_MODEL_LEN = 1024
COLUMNS = ["case", "system", "batch_size", "step_s", "roofline_s", "x_roofline", "tokens_per_s",
           "seconds", "limit_s", "x_limit", "gb"]  # fmt: skip


def build(layers: int, multi_steps: int) -> LLM:
    config = ModelConfig.from_dict({**QWEN3_30B_A3B, "num_hidden_layers": layers})
    kv_bytes = (max(BATCH_SIZES) + 2) * MAX_MODEL_LEN * layers * 2 * 4 * 128 * 2
    return LLM(
        config, max_model_len=MAX_MODEL_LEN, max_num_seqs=max(BATCH_SIZES),
        cuda_graph_batch_sizes=BATCH_SIZES, cuda_graph_multi_steps=multi_steps,
        kv_cache_memory_bytes=kv_bytes,
    )  # fmt: skip


def bench_decode(rec: Recorder, llm: LLM, system: str, bandwidth: float, context: int) -> list:
    worker = llm.llm_engine.executor.worker
    fill_kv_cache(worker.model)  # finite keys and values: the routing sees real activations
    block_size = llm.llm_engine.config.block_size
    rows = []
    for batch_size in BATCH_SIZES:
        step = decode_step(batch_size, context, block_size, llm.llm_engine.runtime.num_kv_blocks)
        experts = count_routed_experts(worker, step)
        nbytes = step_bytes(worker.model, batch_size, context, experts)
        roofline = nbytes["total"] / bandwidth
        times = time_steps(worker.execute, step)
        median = statistics.median(times[3:])
        rows.append(rec.emit(
            case="decode", system=system, batch_size=batch_size, step_s=median,
            min_s=min(times[3:]), max_s=max(times[3:]), tokens_per_s=batch_size / median,
            roofline_s=roofline, x_roofline=median / roofline, bytes=nbytes,
            experts_routed_per_layer=statistics.mean(experts),
        ))  # fmt: skip
        graphs = worker.runner.graphs
        if batch_size == 1 and graphs is not None and graphs.multi_step:
            multi = statistics.median(time_steps(worker.execute_multi_step, step)[3:])
            per_token = multi / graphs.num_steps
            rows.append(rec.emit(
                case="decode multi-step", system=system, batch_size=1, step_s=per_token,
                tokens_per_s=1 / per_token, roofline_s=roofline, x_roofline=per_token / roofline,
            ))  # fmt: skip
    return rows


def pinned_limits(nbytes: int = 2 * GiB) -> tuple[float, float]:
    """Pinned D2H and H2D bandwidth (bytes/s), medians of 3."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(3)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, src in ((host, device), (device, host)):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rates.append(nbytes / statistics.median(times))
    return rates[0], rates[1]


def source_weights(llm: LLM, seed: int) -> list[tuple[str, torch.Tensor]]:
    """New weights on the GPU under the HF names (one tensor per expert projection)."""
    shapes = llm.llm_engine.executor.worker.model.expected_weight_shapes()
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weights = []
    for name, shape in shapes.items():
        tensor = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        weights.append((name, tensor.normal_(0.0, 0.02, generator=generator)))
    return weights


def bench_sleep_wake(rec: Recorder, llm: LLM, bandwidth: float, context: int) -> list:
    worker = llm.llm_engine.executor.worker
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    d2h, h2d = pinned_limits()
    rows = []

    def level_1(case: str) -> None:
        llm.sleep(level=1)
        sleep = llm.memory_status()[0].last_sleep
        llm.wake_up()
        wake = llm.memory_status()[0].last_wake
        for op, report, limit in (("sleep", sleep, weight_bytes / d2h),
                                  ("wake", wake, weight_bytes / h2d)):  # fmt: skip
            rows.append(rec.emit(
                case=f"{case} {op}", system="dormant", seconds=report.total_s, limit_s=limit,
                x_limit=report.total_s / limit, gb=report.bytes_copied / 1e9,
                report={k: v for k, v in vars(report).items() if isinstance(v, int | float)},
            ))  # fmt: skip

    level_1("level-1 (first: sets up the arena)")
    llm.sleep(level=2)
    weights = source_weights(llm, seed=1)  # in the memory the sleep freed
    torch.cuda.synchronize()
    llm.wake_up(["weights"])
    start = time.perf_counter()
    llm.update_weights(weights)
    torch.cuda.synchronize()
    refit_s = time.perf_counter() - start
    source_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    limit = 2 * source_bytes / bandwidth  # read + write, as the copy bandwidth counts
    rows.append(rec.emit(
        case="level-2 refit (update_weights, GPU tensors)", system="dormant", seconds=refit_s,
        limit_s=limit, x_limit=refit_s / limit, gb=source_bytes / 1e9, num_tensors=len(weights),
    ))  # fmt: skip
    del weights
    torch.cuda.empty_cache()
    llm.wake_up(["kv_cache"])
    level_1("level-1 (new weights: copied again)")
    block_size = llm.llm_engine.config.block_size
    step = decode_step(1, context, block_size, llm.llm_engine.runtime.num_kv_blocks)
    fill_kv_cache(worker.model)
    first, second = time_steps(worker.execute, step, repeats=2)
    rows.append(rec.emit(case="first decode after wake", system="dormant", batch_size=1,
                         step_s=first, second_step_s=second))  # fmt: skip
    return rows


def run_child(args: argparse.Namespace, moe_path: str) -> None:
    """Decode alone in a child process: the torch reference path (``moe_path`` "peer";
    DORMANT_TRITON is read at import), or the Triton kernels with the sorted MoE path only
    ("sorted"), without the fused router and the skinny GEMV ("unfused"), or with the loop
    down kernel and plain launches ("plain"), or with the batch-1 PDL knobs off ("knobs-off")."""
    command = [sys.executable, __file__, "--decode-only", "--layers", str(args.layers),
               "--context", str(args.context)]  # fmt: skip
    if args.out:
        command += ["--out", args.out]
    is_peer = moe_path == "peer"
    if not is_peer:
        command += ["--moe-path", moe_path]
    env = {**os.environ, "DORMANT_TRITON": "0"} if is_peer else None
    subprocess.run(command, env=env, check=True)


def sorted_only() -> None:
    """Every ``fused_experts`` call takes the sorted path (graphs capture what they see)."""
    from dormant.layers import triton_moe  # needs triton

    triton_moe.is_direct = lambda num_tokens, top_k: False


def plain_launches() -> None:
    """The batch-1 choices before the tenth session: the experts' loop down kernel, and no
    programmatic dependent launch anywhere (the experts, the router, the decode attention, the
    eleventh session's knobs)."""
    from dormant.layers import triton_attention, triton_moe_direct, triton_router

    knobs_off()
    triton_moe_direct.KERNELS = "loop"
    triton_moe_direct.USE_PDL = triton_router.USE_PDL = False
    triton_attention.USE_PDL_AT_BATCH_1 = False


def knobs_off() -> None:
    """The tenth session's defaults: no PDL in the norms, the rotary kernel and the KV write, and
    cuBLAS for the attention projections at one token (the knobs are on since the eleventh)."""
    from dormant.layers import triton_gemv, triton_kv_cache, triton_norm, triton_rotary

    for module in (triton_gemv, triton_kv_cache, triton_norm, triton_rotary):
        module.USE_PDL_AT_BATCH_1 = False


def fifteenth() -> None:
    """The fifteenth session's batch-1 defaults: the "tile" experts (gate/up in steps of 256
    of the depth) and the PDL GEMV at 16 / 8 rows a program (QKV / O)."""
    from dormant.layers import triton_gemv, triton_moe_direct

    triton_moe_direct.KERNELS = "tile"
    triton_gemv.PDL_PROGRAMS, triton_gemv.PDL_ACCUMULATOR = 256, 4096


def unfused() -> None:
    """Every sparse layer routes by the router's GEMM and ``topk_softmax`` (as before
    ``layers/triton_router.py``), and the attention projections run cuBLAS (as before
    ``layers/triton_gemv.py``), with the batch-1 PDL knobs off."""
    from dormant.layers import linear
    from dormant.models import qwen3_moe

    knobs_off()
    qwen3_moe.is_router_fused = lambda num_tokens: False
    linear.is_skinny = lambda num_tokens: False


# The child runs' setups: --moe-path's name -> (the system its rows name, what it changes)
MOE_PATHS = {
    "sorted": ("triton, sorted MoE path (old)", sorted_only),
    "unfused": ("triton, unfused router, cuBLAS attention (old)", unfused),
    "plain": ("triton, loop down kernel, plain launches (old)", plain_launches),
    "knobs-off": ("triton, no PDL norms/rotary/KV write, cuBLAS GEMV (tenth session)", knobs_off),
    "fifteenth": ("triton, tile experts, 16/8-row PDL GEMV (fifteenth session)", fifteenth),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--layers", type=int, default=48, help="decoder layers (48: the model)")
    parser.add_argument("--context", type=int, default=512, help="tokens in each sequence's KV")
    parser.add_argument("--skip-peer", action="store_true", help="no torch-reference run")
    parser.add_argument("--skip-kernels", action="store_true",
                        help="no per-kernel sweeps: experts, routers, GEMVs")  # fmt: skip
    parser.add_argument("--skip-sorted", action="store_true", help="no old (sorted-path) step")
    parser.add_argument("--skip-unfused", action="store_true",
                        help="no step with the old router and cuBLAS attention")  # fmt: skip
    parser.add_argument("--skip-plain", action="store_true",
                        help="no step with the loop down kernel and plain launches")  # fmt: skip
    parser.add_argument("--skip-knobs-off", action="store_true",
                        help="no step with the batch-1 PDL knobs off")  # fmt: skip
    parser.add_argument("--skip-fifteenth", action="store_true",
                        help="no step with the fifteenth session's tiles")  # fmt: skip
    parser.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--moe-path", choices=("auto", *MOE_PATHS),
                        default="auto", help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    rec = Recorder(args.out)
    system = "triton" if IS_TRITON_ENABLED else "torch reference"
    if IS_TRITON_ENABLED and args.moe_path in MOE_PATHS:
        system, set_up = MOE_PATHS[args.moe_path]
        set_up()
    bandwidth = device_copy_bandwidth()
    if args.decode_only:
        llm = build(args.layers, multi_steps=1)
        rows = bench_decode(rec, llm, system, bandwidth, args.context)
        llm.shutdown()
        print(table(rows, COLUMNS))
        return
    rec.emit(case="environment", triton_kernels=IS_TRITON_ENABLED, **environment())
    start = time.perf_counter()
    llm = build(args.layers, multi_steps=4)
    worker = llm.llm_engine.executor.worker
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    rec.emit(case="setup", layers=args.layers, weight_bytes=weight_bytes,
             load_and_capture_s=time.perf_counter() - start, d2d_bytes_per_s=bandwidth)  # fmt: skip
    rows = bench_decode(rec, llm, system, bandwidth, args.context)
    if IS_TRITON_ENABLED and not args.skip_kernels:
        from benchmarks.moe_gemv import bench_gemv  # these need triton
        from benchmarks.moe_kernels import bench_experts
        from benchmarks.moe_router import bench_router

        bench_experts(rec, worker.model, bandwidth)
        bench_router(rec, worker.model, bandwidth)
        bench_gemv(rec, worker.model, bandwidth)
    rows += bench_sleep_wake(rec, llm, bandwidth, args.context)
    print(llm.memory_status()[0].table())
    llm.shutdown()
    del llm, worker
    torch.cuda.empty_cache()
    print(table(rows, COLUMNS))
    if IS_TRITON_ENABLED and not args.skip_fifteenth:
        run_child(args, "fifteenth")
    if IS_TRITON_ENABLED and not args.skip_knobs_off:
        run_child(args, "knobs-off")
    if IS_TRITON_ENABLED and not args.skip_plain:
        run_child(args, "plain")
    if IS_TRITON_ENABLED and not args.skip_unfused:
        run_child(args, "unfused")
    if IS_TRITON_ENABLED and not args.skip_sorted:
        run_child(args, "sorted")
    if not args.skip_peer:
        run_child(args, "peer")


if __name__ == "__main__":
    main()
