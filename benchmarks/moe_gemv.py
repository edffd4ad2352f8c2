"""The attention projections of every layer alone, for ``benchmarks/moe.py``: cuBLAS
(``F.linear``) against the skinny GEMV (``skinny_linear``, what the MoE model runs at decode
sizes), each replayed from one CUDA graph over all the model's layers (so each layer's weights
come from HBM, not L2), per projection (QKV, O) and batch size 1..4, at the default tiles and at
a few others: per layer, the time and the weight bytes over it (TB/s) against the copy
bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.common import Recorder, table
from benchmarks.moe_kernels import replay_seconds
from dormant.layers.triton_gemv import SKINNY_MAX_TOKENS, GemvTiles, gemv_tiles, skinny_linear

CANDIDATES = [GemvTiles(4, 512), GemvTiles(8, 256), GemvTiles(16, 256), GemvTiles(2, 1024),
              GemvTiles(8, 512, num_warps=8), GemvTiles(4, 256, num_stages=4)]  # fmt: skip
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _all_layers(weights: list[torch.Tensor], x: torch.Tensor, linear: Linear) -> None:
    for weight in weights:
        linear(x, weight)


def bench_gemv(rec: Recorder, model: torch.nn.Module, bandwidth: float) -> None:
    layers = [layer.self_attn for layer in model.model.layers]
    projections = {
        "qkv": [a.qkv_proj.weight for a in layers],
        "o": [a.o_proj.weight for a in layers],
    }
    side_by_side = []
    for name, weights in projections.items():
        n, k = weights[0].shape
        nbytes = weights[0].numel() * weights[0].element_size()
        for batch_size in range(1, SKINNY_MAX_TOKENS + 1):
            generator = torch.Generator(device=weights[0].device).manual_seed(batch_size)
            x = torch.randn(batch_size, k, device=weights[0].device, generator=generator)
            x = x.to(weights[0].dtype)
            cublas = replay_seconds(partial(_all_layers, weights, x, F.linear)) / len(weights)
            default = gemv_tiles(batch_size, n, k)
            per_layer = {}
            for tiles in [None, *(c for c in CANDIDATES if c != default)]:
                linear = partial(skinny_linear, tiles=tiles)
                seconds = replay_seconds(partial(_all_layers, weights, x, linear)) / len(weights)
                rec.emit(
                    case="attention projection alone, per layer", projection=name,
                    batch_size=batch_size, system="triton, skinny GEMV", per_layer_s=seconds,
                    tiles=f"default {default}" if tiles is None else str(tiles),
                    tb_per_s=nbytes / seconds / 1e12, roofline_s=nbytes / bandwidth,
                )  # fmt: skip
                per_layer[tiles] = seconds
            side_by_side.append(rec.emit(
                case="attention projection per layer, cuBLAS vs skinny GEMV", projection=name,
                shape=f"[{n}, {k}]", batch_size=batch_size, cublas_us=cublas * 1e6,
                skinny_us=per_layer[None] * 1e6, skinny_over_cublas=per_layer[None] / cublas,
                best_us=min(per_layer.values()) * 1e6, cublas_tb_per_s=nbytes / cublas / 1e12,
                skinny_tb_per_s=nbytes / per_layer[None] / 1e12,
                roofline_us=nbytes / bandwidth * 1e6,
            ))  # fmt: skip
    columns = ["projection", "batch_size", "cublas_us", "skinny_us", "skinny_over_cublas",
               "best_us", "cublas_tb_per_s", "skinny_tb_per_s", "roofline_us"]  # fmt: skip
    print(table(side_by_side, columns))
