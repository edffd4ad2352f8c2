"""The routers of every layer alone, for ``benchmarks/moe.py``: the old routing (cuBLAS's GEMV
for ``x @ gate.T``, then ``topk_softmax``: two launches) against the fused router
(``router_topk``: one), each replayed from one CUDA graph over all the model's sparse layers,
per batch size up to ``FUSED_ROUTER_MAX_TOKENS``, at the default tiles and at a few others
(whether ``router_config`` is the best of them). The router's weights are 0.5 MB a layer at
Qwen3-30B-A3B's size, about 0.12 us at the copy bandwidth: the figures are latency.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.common import Recorder, table
from benchmarks.moe_kernels import replay_seconds
from dormant.layers.triton_moe_routing import topk_softmax
from dormant.layers.triton_router import (
    FUSED_ROUTER_MAX_TOKENS,
    RouterConfig,
    router_config,
    router_topk,
)
from dormant.models.qwen3_moe import SparseMoeBlock

# block_e x block_k <= 2048 (more spills registers: ptxas, sm_90)
CANDIDATES = [RouterConfig(1, 1024), RouterConfig(1, 512), RouterConfig(2, 1024),
              RouterConfig(4, 512), RouterConfig(8, 256)]  # fmt: skip


def _unfused(blocks: list[SparseMoeBlock], x: torch.Tensor) -> None:
    for block in blocks:
        experts = block.experts
        topk_softmax(F.linear(x, block.gate.weight), experts.top_k, experts.renormalize)


def _fused(blocks: list[SparseMoeBlock], x: torch.Tensor, config: RouterConfig | None) -> None:
    for block in blocks:
        experts = block.experts
        router_topk(x, block.gate.weight, experts.top_k, experts.renormalize,
                    block.router_ticket, config)  # fmt: skip


def bench_router(rec: Recorder, model: torch.nn.Module, bandwidth: float) -> None:
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    first = blocks[0]
    weight = first.gate.weight
    num_experts, hidden = weight.shape
    nbytes = len(blocks) * weight.numel() * weight.element_size()
    side_by_side = []
    for batch_size in range(1, FUSED_ROUTER_MAX_TOKENS + 1):
        generator = torch.Generator(device=weight.device).manual_seed(batch_size)
        x = torch.randn(batch_size, hidden, device=weight.device, generator=generator)
        x = x.to(weight.dtype)

        per_layer = {"unfused": replay_seconds(partial(_unfused, blocks, x)) / len(blocks)}
        default = router_config(num_experts, hidden)
        for config in [None, *(c for c in CANDIDATES if c != default)]:
            seconds = replay_seconds(partial(_fused, blocks, x, config))
            row = rec.emit(
                case="router alone, all layers", system="triton, fused router",
                batch_size=batch_size, seconds=seconds, per_layer_s=seconds / len(blocks),
                tiles=f"default {default}" if config is None else str(config),
                roofline_s=nbytes / bandwidth,
            )  # fmt: skip
            if config is None:
                per_layer["fused"] = row["per_layer_s"]
        assert all(int(block.router_ticket) == 0 for block in blocks), "a ticket was left set"
        side_by_side.append(rec.emit(
            case="router per layer, unfused vs fused", batch_size=batch_size,
            unfused_us=per_layer["unfused"] * 1e6, fused_us=per_layer["fused"] * 1e6,
            fused_over_unfused=per_layer["fused"] / per_layer["unfused"],
        ))  # fmt: skip
    print(table(side_by_side, ["batch_size", "unfused_us", "fused_us", "fused_over_unfused"]))
