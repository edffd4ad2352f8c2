"""The experts of every layer alone, for ``benchmarks/moe.py``: the fused Triton path (routing
included) replayed from one CUDA graph over all the model's MoE layers, per tile
configuration, against the bytes of the experts it routes to over the HBM bandwidth. The
default tiles (``block_config``) are one line; the others say whether a retune pays."""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import Recorder
from dormant.layers.moe import FusedMoE
from dormant.layers.triton_moe import BlockConfig, block_config, fused_experts
from dormant.layers.triton_moe_routing import topk_softmax

# (block_m, gate/up block_n, block_k, down block_n, block_k, warps, stages)
CANDIDATES = {
    1: [(16, 64, 128, 64, 128, 4, 3), (16, 32, 64, 32, 128, 4, 4), (16, 16, 128, 32, 128, 4, 4),
        (16, 32, 256, 32, 256, 4, 3), (16, 64, 64, 128, 64, 8, 3)],
    64: [(16, 64, 128, 64, 128, 4, 3), (16, 32, 64, 64, 64, 4, 4), (32, 64, 64, 64, 64, 4, 3),
         (64, 64, 64, 64, 64, 4, 3)],
}  # fmt: skip


def _configs(candidate: tuple[int, ...]) -> tuple[BlockConfig, BlockConfig]:
    block_m, up_n, up_k, down_n, down_k, warps, stages = candidate
    return (
        BlockConfig(block_m, up_n, up_k, warps, stages),
        BlockConfig(block_m, down_n, down_k, warps, stages),
    )


def bench_experts(rec: Recorder, model: torch.nn.Module, bandwidth: float) -> None:
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    first = layers[0]
    for batch_size, candidates in CANDIDATES.items():
        generator = torch.Generator(device="cuda").manual_seed(batch_size)
        x = torch.randn(batch_size, first.hidden_size, device="cuda", generator=generator)
        x = x.to(first.w13_weight.dtype)
        logits = torch.randn(batch_size, first.num_experts, device="cuda", generator=generator)
        _, ids = topk_softmax(logits, first.top_k, first.renormalize)
        per_expert = first.w13_weight[0].numel() + first.w2_weight[0].numel()
        nbytes = len(layers) * int(torch.unique(ids).numel()) * per_expert * 2
        inter, hidden = first.local_intermediate_size, first.hidden_size
        default = (
            block_config(batch_size, first.top_k, first.num_experts, inter, hidden, x.dtype, True),
            block_config(batch_size, first.top_k, first.num_experts, hidden, inter, x.dtype),
        )
        for candidate in [None, *candidates]:
            configs = None if candidate is None else _configs(candidate)
            seconds = _time_layers(layers, x, logits, configs)
            rec.emit(
                case="experts alone, all layers", system="triton", batch_size=batch_size,
                tiles="default " + str(default) if candidate is None else str(candidate),
                seconds=seconds, per_layer_s=seconds / len(layers),
                roofline_s=nbytes / bandwidth, x_roofline=seconds * bandwidth / nbytes,
            )  # fmt: skip


def _time_layers(layers: list[FusedMoE], x: torch.Tensor, logits: torch.Tensor,
                 configs: tuple[BlockConfig, BlockConfig] | None) -> float:  # fmt: skip
    def run() -> None:
        for layer in layers:
            weights, ids = topk_softmax(logits, layer.top_k, layer.renormalize)
            fused_experts(x, layer.w13_weight, layer.w2_weight, weights, ids, configs)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    times = []
    for _ in range(12):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del graph
    return statistics.median(times[2:])
