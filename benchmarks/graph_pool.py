"""Graph pools and capture scopes: the bytes a sleep frees, and sleep/wake times.

- The engine's CUDA-graph pool (an 8B-like model, decode graphs for batch 1..64, fused
  multi-step graphs): sleeping the ``cuda_graph`` tag with HOST (the default) and DISCARD.
  torch_memory_saver's torch hook mode cannot pause graph memory at all: there is no peer here.
- 4 GiB of ordinary torch allocations made inside ``mm.capture("workspace")`` against the same
  allocations inside a torch_memory_saver region (torch hook mode), without and with backup.

Usage: python benchmarks/graph_pool.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder, environment, table, timed
from benchmarks.decode import QWEN3_8B_LIKE
from dormant import LLM
from dormant.memory import MemoryManager
from dormant.models import ModelConfig

CAPTURE_SIZES = [64 * MiB] * 48 + [16 * MiB] * 48  # 3.75 GiB, caching-allocator-sized pieces


def cycles(sleep, wake, count: int = 4) -> tuple[list[float], list[float]]:
    sleeps, wakes = [], []
    for _ in range(count):
        sleeps.append(timed(sleep)[0])
        time.sleep(0.25)  # the trainer's step
        wakes.append(timed(wake)[0])
    return sleeps[1:], wakes[1:]  # the first cycle sets up the host arena


def bench_graph_pool(rec: Recorder) -> list[dict]:
    llm = LLM(
        ModelConfig.from_dict(QWEN3_8B_LIKE),
        max_model_len=4096,
        max_num_seqs=64,
        gpu_memory_utilization=0.5,
    )
    mm = llm.llm_engine.executor.worker.mm
    pool_bytes = mm.status().tag("cuda_graph").mapped_bytes
    rows = []
    for policy in ("host", "discard"):
        sleeps, wakes = cycles(
            lambda p=policy: mm.sleep(tags={"cuda_graph": p}), lambda: mm.wake_up(["cuda_graph"])
        )
        freed = pool_bytes - mm.status().tag("cuda_graph").mapped_bytes
        rows.append(
            rec.series("engine graph pool", "dormant", f"sleep {policy}", sleeps, pool_bytes)
        )
        rows.append(
            rec.series(
                "engine graph pool",
                "dormant",
                f"wake {policy}",
                wakes,
                pool_bytes,
                freed_while_awake=freed,
            )
        )
    out = llm.generate("graphs survive", None)[0].outputs[0].token_ids  # replays after wake
    rec.emit(
        case="engine graph pool",
        system="dormant",
        op="generate after wake",
        nbytes=pool_bytes,
        median_s=0.0,
        tokens=len(out),
    )
    llm.shutdown()
    return rows


def bench_capture(rec: Recorder) -> list[dict]:
    rows = []
    mm = MemoryManager("cuda")
    with mm.capture("workspace"):
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in CAPTURE_SIZES]
    for t in tensors:
        t.fill_(7)
    nbytes = sum(CAPTURE_SIZES)
    reserved = mm.status().tag("workspace").mapped_bytes
    for policy in ("discard", "host"):
        sleeps, wakes = cycles(
            lambda p=policy: mm.sleep(tags={"workspace": p}), lambda: mm.wake_up(["workspace"])
        )
        rows.append(
            rec.series(
                "capture 3.75 GiB",
                "dormant",
                f"sleep {policy}",
                sleeps,
                nbytes,
                freed_bytes=reserved,
            )
        )
        rows.append(rec.series("capture 3.75 GiB", "dormant", f"wake {policy}", wakes, nbytes))
    del tensors
    gc.collect()
    mm.close()
    torch.cuda.empty_cache()

    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    for backup in (False, True):
        tag = f"capture_{backup}"
        with tms.region(tag=tag, enable_cpu_backup=backup):
            tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in CAPTURE_SIZES]
        for t in tensors:
            t.fill_(7)
        if backup:
            tms.retain_cpu_backup = True
        sleeps, wakes = cycles(lambda t=tag: tms.pause(t), lambda t=tag: tms.resume(t))
        op = "host" if backup else "discard"
        rows.append(rec.series("capture 3.75 GiB", "tms", f"sleep {op}", sleeps, nbytes))
        rows.append(rec.series("capture 3.75 GiB", "tms", f"wake {op}", wakes, nbytes))
        del tensors
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    rows = bench_graph_pool(rec) + bench_capture(rec)
    for row in rows:
        row["median_ms"] = row["median_s"] * 1e3
        row["MiB"] = row["nbytes"] / MiB
    print(table(rows, ["case", "system", "op", "MiB", "median_ms", "gbps"]))


if __name__ == "__main__":
    main()
