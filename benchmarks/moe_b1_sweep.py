"""The MoE batch-1 decode kernels, each choice of tiles, kernels and launch (issue 18): which
defaults bring the step within 2x its roofline. One call on the H200, about 3 minutes.

Qwen3-30B-A3B's shapes (hidden 2048, 128 experts, top-8, moe_intermediate 768; 32 q / 4 kv
heads, head_dim 128), batch 1, context 512 in graphs planned for ``benchmarks/moe.py``'s
max_model_len of 1024 (``benchmarks/moe_b1_chains.py``). Three chains, each as the model runs
it, with the kernel before included (programmatic dependent launch, ``triton_pdl.py``, only
pays against the kernel before it):

| group     | per layer                                         | layers (bytes a layer reads) |
|-----------|---------------------------------------------------|------------------------------|
| moe       | rms_norm (+ residual), router_topk, the experts   | 12 (~76 MB: L2 holds none)   |
| attention | write_kv_cache, paged_decode_attention            | 96 (1 MB of KV: 96 MB)       |
| layer     | the whole decoder layer: rms_norm, QKV, rotary,   | 12 (~115 MB)                 |
|           | KV write, attention, O, rms_norm, router, experts |                              |

Each variant: captured in one CUDA graph over the group's layers, replayed 3 times to warm
up, then 20 timed replays (CUDA events): the median per layer. Then fresh random inputs are
written into the graph's inputs, it replays once, and its outputs are compared with the
current default run eagerly on the same inputs (the layer group: with the variant's own kernels
launched plainly, ``Chain.reference``): routing ids identical, outputs within the bf16
tolerance of another sum order (``bit_exact`` says whether they are the same bits, which every
variant that changes only the launch must be). A variant that raises is a row with its
error; the PDL variants run last, so a fault there cannot hide the others.

Usage: python benchmarks/moe_b1_sweep.py [--out results.jsonl] [--only moe,attention,layer]
[--budget-s 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table
from benchmarks.moe_b1_chains import GROUPS, Chain, Variant

NUM_WARMUP, NUM_TIMED = 3, 20


def replay_per_layer(graph: torch.cuda.CUDAGraph, num_layers: int) -> list[float]:
    """Seconds per layer of ``NUM_TIMED`` replays, after ``NUM_WARMUP``."""
    for _ in range(NUM_WARMUP):
        graph.replay()
    times = []
    for _ in range(NUM_TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / num_layers)
    return times


def capture(run: Callable[[], list[torch.Tensor]]) -> tuple[torch.cuda.CUDAGraph, list]:
    """``run`` once eagerly on a side stream (compiles), then captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    return graph, outputs


def compare(ours: list[torch.Tensor], expected: list[torch.Tensor]) -> dict[str, object]:
    """Integer outputs (routing ids) must be equal; float ones within the bf16 tolerance of
    tests/layers/moe_kernel_checks.py (max error 2 % of the largest value, mean 0.2 %)."""
    bit_exact, is_ok, worst = True, True, 0.0
    for a, b in zip(ours, expected, strict=True):
        same = torch.equal(a, b)
        bit_exact &= same
        if a.dtype in (torch.int32, torch.int64):
            is_ok &= same
            continue
        scale = max(float(b.float().abs().max()), 1e-30)
        error = (a.float() - b.float()).abs()
        worst = max(worst, float(error.max()) / scale)
        is_ok &= bool(error.max() <= 0.02 * scale) and float(error.mean()) < 2e-3 * scale
        is_ok &= bool(torch.isfinite(a.float()).all())
    return {"is_ok": is_ok, "bit_exact": bit_exact, "max_err_rel": worst}


def run_variant(rec: Recorder, chain: Chain, variant: Variant, baseline_s: float | None) -> dict:
    try:
        graph, outputs = capture(lambda: chain.run(variant))
        times = replay_per_layer(graph, chain.num_layers)
        median = statistics.median(times)
        chain.refill(seed=1234)
        graph.replay()
        torch.cuda.synchronize()
        checked = compare(outputs, chain.run(chain.reference(variant)))
        del graph, outputs
    except Exception as error:  # a variant that does not compile or launch: its row says why
        traceback.print_exc()
        return rec.emit(group=chain.name, variant=variant.name, error=repr(error)[:300])
    return rec.emit(
        group=chain.name, variant=variant.name, per_layer_us=median * 1e6,
        min_us=min(times) * 1e6, max_us=max(times) * 1e6,
        delta_us=None if baseline_s is None else (median - baseline_s) * 1e6,
        is_default=variant == chain.default, **checked, **variant.knobs,
    )  # fmt: skip


def main() -> None:
    """Every variant of every group, the PDL ones last; then the table and, per group, the
    fastest variant whose outputs check."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON lines are appended here too")
    parser.add_argument("--only", default=",".join(GROUPS), help="comma-separated groups")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="no new variant starts after this many seconds")  # fmt: skip
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    chains = [GROUPS[name]() for name in args.only.split(",")]
    rows: list[dict] = []
    baselines: dict[str, float] = {}
    start = time.perf_counter()
    for is_pdl in (False, True):  # every PDL variant after every other one
        for chain in chains:
            for variant in chain.variants:
                if variant.is_pdl != is_pdl:
                    continue
                if time.perf_counter() - start > args.budget_s:
                    rows.append(
                        rec.emit(
                            group=chain.name, variant=variant.name, error="skipped: --budget-s"
                        )
                    )
                    continue
                row = run_variant(rec, chain, variant, baselines.get(chain.name))
                if variant == chain.default and "per_layer_us" in row:
                    baselines[chain.name] = row["per_layer_us"] / 1e6
                rows.append(row)
    columns = ["group", "variant", "per_layer_us", "delta_us", "is_ok", "bit_exact", "max_err_rel"]
    print(table(rows, columns))
    for chain in chains:
        good = [r for r in rows if r["group"] == chain.name and r.get("is_ok")]
        if good:
            best = min(good, key=lambda r: r["per_layer_us"])
            rec.emit(case="suggested default", group=chain.name, variant=best["variant"],
                     per_layer_us=best["per_layer_us"], delta_us=best.get("delta_us"),
                     saved_at_48_layers_us=-48 * (best.get("delta_us") or 0.0))  # fmt: skip


if __name__ == "__main__":
    main()
