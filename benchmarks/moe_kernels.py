"""The experts of every layer alone, for ``benchmarks/moe.py``: the fused Triton paths (routing
included) replayed from one CUDA graph over all the model's MoE layers, against the bytes of
the experts they route to over the HBM bandwidth.

- old against new, side by side per batch size (1, 2, 4, 8, 16, 64): the sorted path (align,
  gate/up, down, combine) and the direct one (gate/up, down + combine), at their default
  tiles, and which one ``fused_experts`` picks (``is_direct``): where the direct path stops
  paying says where ``DIRECT_MAX_PAIRS`` belongs; where it is picked, also the direct path's
  "tile" kernels (the fifteenth session's) against ``KERNELS``;
- per tile configuration at batch 1 (both paths), 8 (direct) and 64 (sorted): whether retuning
  ``block_config`` or ``gemv_config`` pays.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import Recorder, table
from dormant.layers.moe import FusedMoE
from dormant.layers.triton_moe import BlockConfig, block_config, fused_experts_sorted
from dormant.layers.triton_moe_direct import (
    KERNELS,
    GemvConfig,
    fused_experts_direct,
    gemv_config,
    is_direct,
)
from dormant.layers.triton_moe_routing import topk_softmax

BATCH_SIZES = (1, 2, 4, 8, 16, 64)
# sorted: (block_m, gate/up block_n, block_k, down block_n, block_k, warps, stages)
SORTED_CANDIDATES = {
    1: [(16, 64, 128, 64, 128, 4, 3), (16, 32, 64, 32, 128, 4, 4), (16, 16, 128, 32, 128, 4, 4),
        (16, 32, 256, 32, 256, 4, 3), (16, 64, 64, 128, 64, 8, 3)],
    64: [(16, 64, 128, 64, 128, 4, 3), (16, 32, 64, 64, 64, 4, 4), (32, 64, 64, 64, 64, 4, 3),
         (64, 64, 64, 64, 64, 4, 3)],
}  # fmt: skip
# direct: (gate/up block_n, block_k, warps, stages, down block_n, block_k, warps)
DIRECT_CANDIDATES = {
    1: [(8, 256, 4, 3, 4, 256, 4), (32, 128, 4, 3, 4, 256, 4), (16, 512, 8, 3, 4, 256, 4),
        (16, 256, 4, 4, 4, 256, 4), (16, 128, 4, 2, 4, 256, 4), (16, 256, 8, 3, 8, 256, 4),
        (16, 256, 4, 3, 2, 256, 2), (16, 256, 4, 3, 4, 128, 2), (16, 256, 4, 3, 8, 512, 8),
        (16, 256, 4, 3, 16, 256, 8), (32, 256, 8, 3, 4, 256, 4)],
    8: [(32, 256, 8, 3, 8, 256, 4), (16, 256, 4, 3, 8, 256, 4), (64, 128, 8, 3, 16, 256, 8)],
}  # fmt: skip
Run = Callable[[FusedMoE, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _sorted(candidate: tuple[int, ...] | None) -> Run:
    configs = None
    if candidate is not None:
        block_m, up_n, up_k, down_n, down_k, warps, stages = candidate
        up = BlockConfig(block_m, up_n, up_k, warps, stages)
        configs = (up, BlockConfig(block_m, down_n, down_k, warps, stages))
    return lambda layer, x, weights, ids: fused_experts_sorted(
        x, layer.w13_weight, layer.w2_weight, weights, ids, configs
    )


def _direct(candidate: tuple[int, ...] | None, kernels: str | None = None) -> Run:
    """The direct path at ``KERNELS`` (or ``kernels``); a candidate's tiles are the loop gate/up
    kernel's, so they run with ``kernels="tile"``."""
    configs = None
    if candidate is not None:
        up_n, up_k, up_warps, stages, down_n, down_k, down_warps = candidate
        configs = (GemvConfig(up_n, up_k, up_warps, stages), GemvConfig(down_n, down_k, down_warps))
        kernels = "tile"
    return lambda layer, x, weights, ids: fused_experts_direct(
        x, layer.w13_weight, layer.w2_weight, weights, ids, configs, kernels=kernels
    )


def bench_experts(rec: Recorder, model: torch.nn.Module, bandwidth: float) -> None:
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    first = layers[0]
    inter, hidden, top_k = first.local_intermediate_size, first.hidden_size, first.top_k
    device = first.w13_weight.device
    side_by_side = []
    for batch_size in BATCH_SIZES:
        generator = torch.Generator(device=device).manual_seed(batch_size)
        x = torch.randn(batch_size, hidden, device=device, generator=generator)
        x = x.to(first.w13_weight.dtype)
        logits = torch.randn(batch_size, first.num_experts, device=device, generator=generator)
        _, ids = topk_softmax(logits, top_k, first.renormalize)
        per_expert = first.w13_weight[0].numel() + first.w2_weight[0].numel()
        nbytes = len(layers) * int(torch.unique(ids).numel()) * per_expert * 2
        defaults = {
            "sorted": (
                block_config(batch_size, top_k, first.num_experts, inter, hidden, x.dtype, True),
                block_config(batch_size, top_k, first.num_experts, hidden, inter, x.dtype),
            ),
            "direct": (gemv_config(inter, hidden, True, KERNELS),
                       gemv_config(hidden, inter, False, KERNELS)),
            "direct, tile": (gemv_config(inter, hidden, True, "tile"),
                             gemv_config(hidden, inter, False, "tile")),
        }  # fmt: skip
        cases: list[tuple[str, tuple[int, ...] | None]] = [("sorted", None), ("direct", None)]
        if is_direct(batch_size, top_k):  # the fifteenth session's kernels, against KERNELS
            cases.append(("direct, tile", None))
        cases += [("sorted", c) for c in SORTED_CANDIDATES.get(batch_size, [])]
        cases += [("direct", c) for c in DIRECT_CANDIDATES.get(batch_size, [])]
        per_layer = {}
        for path, candidate in cases:
            if path == "sorted":
                run = _sorted(candidate)
            else:
                run = _direct(candidate, "tile" if path == "direct, tile" else None)
            seconds = _time_layers(layers, x, logits, run)
            row = rec.emit(
                case="experts alone, all layers", system="triton", path=path,
                batch_size=batch_size, seconds=seconds, per_layer_s=seconds / len(layers),
                tiles=f"default {defaults[path]}" if candidate is None else str(candidate),
                roofline_s=nbytes / bandwidth, x_roofline=seconds * bandwidth / nbytes,
            )  # fmt: skip
            if candidate is None:
                per_layer[path] = row["per_layer_s"]
        picked = "direct" if is_direct(batch_size, top_k) else "sorted"
        tile_us = per_layer["direct, tile"] * 1e6 if "direct, tile" in per_layer else None
        side_by_side.append(rec.emit(
            case="experts per layer, sorted vs direct", batch_size=batch_size,
            sorted_us=per_layer["sorted"] * 1e6, direct_us=per_layer["direct"] * 1e6,
            direct_tile_us=tile_us, kernels=KERNELS,
            direct_over_sorted=per_layer["direct"] / per_layer["sorted"], picked=picked,
            roofline_us=nbytes / bandwidth / len(layers) * 1e6,
        ))  # fmt: skip
    columns = ["batch_size", "sorted_us", "direct_us", "direct_tile_us", "direct_over_sorted",
               "picked"]  # fmt: skip
    print(table(side_by_side, [*columns, "roofline_us"]))


def _time_layers(
    layers: list[FusedMoE], x: torch.Tensor, logits: torch.Tensor, experts: Run
) -> float:
    def run() -> None:
        for layer in layers:
            weights, ids = topk_softmax(logits, layer.top_k, layer.renormalize)
            experts(layer, x, weights, ids)

    return replay_seconds(run)


def replay_seconds(run: Callable[[], object]) -> float:
    """``run`` captured in one CUDA graph (after a warm-up that compiles its kernels), then the
    median of 10 replays (12, the first two dropped)."""
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
