"""What the residual's "kernels loaded" rows are made of (issue 17, section 4): the device memory
that loading code leaves in a fresh process, by source, each step measured in place.

After ``torch.cuda.init`` the device's used bytes (``cudaMemGetInfo``) are the baseline. Each
step then runs some work and reports how much the process's device memory grew beyond torch's
own reserved bytes (so torch's caching allocator is not counted: what is left is the driver's:
modules, handles, graph executables):

- ``torch elementwise``: a few of torch's own kernels (fill, add, mul, copy, cast);
- ``cublas first gemm``: one bf16 GEMM (the cuBLAS/cuBLASLt handles);
- ``cublas decode shapes``: the 8B-like model's GEMM shapes at every decode batch bucket;
- ``triton first kernel``: one Triton kernel; then ``triton N specializations``: the same
  kernel compiled for N more (constexpr, divisibility) variants, each its own module, to find
  the per-module cost;
- ``graph capture``: a CUDA graph of the GEMMs above, instantiated;
- ``engine warm-up``: the residual benchmark's small Qwen3 with FULL and 4-step graphs
  (``benchmarks/residual.py``'s model).

    python benchmarks/residual_sources.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MiB, Recorder, environment

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
GEMM_SHAPES = ((4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096))  # (K, N) of the 8B


class Meter:
    """The process's device memory beyond torch's reserved bytes, relative to the baseline."""

    def __init__(self, rec: Recorder) -> None:
        torch.cuda.init()
        self.rec = rec
        self.baseline = self._driver_bytes()
        self.last = 0

    def _driver_bytes(self) -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()

    def step(self, name: str, **extra: Any) -> None:
        grown = self._driver_bytes() - self.baseline
        self.rec.emit(
            case="step", step=name, grown_MiB=(grown - self.last) / MiB,
            total_MiB=grown / MiB, torch_reserved_MiB=torch.cuda.memory_reserved() / MiB, **extra,
        )  # fmt: skip
        self.last = grown


_KERNEL: Any = None


def triton_variants(count: int) -> int:
    """Runs one trivial Triton kernel in its first ``count`` variants (each a module of its own,
    compiled once: later calls add only the new ones); returns ``count``."""
    global _KERNEL
    import triton
    import triton.language as tl

    if _KERNEL is None:

        @triton.jit
        def _add(x_ptr, n, BLOCK: tl.constexpr, VALUE: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + VALUE, mask=mask)

        _KERNEL = _add
    x = torch.ones(1 << 16, device="cuda")
    for index in range(count):
        _KERNEL[(4,)](x, x.numel(), BLOCK=64 << (index % 4), VALUE=index // 4)
    return count


def engine_warm_up() -> None:
    from benchmarks.residual import SMALL_QWEN3
    from dormant import LLM, SamplingParams
    from dormant.models import ModelConfig

    llm = LLM(
        ModelConfig.from_dict(SMALL_QWEN3), max_model_len=1024, max_num_seqs=32, seed=0,
        kv_cache_memory_bytes=512 * MiB, cuda_graph_multi_steps=4,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([[11, 12, 13]] * 4, params, use_tqdm=False)
    llm.shutdown()


def limits() -> dict[str, int]:
    """The context's stack, heap and printf limits, and its flags (the driver's API)."""
    from dormant.memory.cuda_driver import call, driver

    cu = driver()
    names = ("CU_LIMIT_STACK_SIZE", "CU_LIMIT_MALLOC_HEAP_SIZE", "CU_LIMIT_PRINTF_FIFO_SIZE")
    values = {name: int(call("cuCtxGetLimit", getattr(cu.CUlimit, name))) for name in names}
    return {**values, "ctx_flags": int(call("cuCtxGetFlags"))}


def set_limit(name: str, value: int) -> None:
    from dormant.memory.cuda_driver import call, driver

    call("cuCtxSetLimit", getattr(driver().CUlimit, name), value)


def capture(nodes: int, h: torch.Tensor, w: torch.Tensor) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes // 2):
            h = (h @ w).relu_()
    graph.replay()
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    meter = Meter(rec)
    meter.step("nothing yet", **limits())

    x = torch.empty(1 << 20, device="cuda")
    meter.step("torch allocation, no kernel")
    x.fill_(1.0)
    meter.step("torch fill kernel", **limits())
    (x + 1).mul_(2).to(torch.bfloat16).float()
    meter.step("torch elementwise (add, mul, casts)", **limits())

    a = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    a @ w
    meter.step("cublas first gemm", **limits())
    weights = {
        shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in GEMM_SHAPES
    }
    for m in DECODE_BUCKETS:
        h = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        for (k, _n), wt in weights.items():
            (h if k == 4096 else torch.randn(m, k, device="cuda", dtype=torch.bfloat16)) @ wt
    meter.step("cublas decode shapes", gemms=len(DECODE_BUCKETS) * len(GEMM_SHAPES), **limits())

    triton_variants(1)
    meter.step("triton first kernel")
    for count in (8, 32, 128):
        triton_variants(count)
        meter.step(f"triton {count} specializations", variants=count)

    h = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    for nodes in (2, 100, 100):
        graph = capture(nodes, h, w)
        meter.step(f"graph of {nodes} nodes captured", **limits())
        del graph
        gc.collect()
        meter.step(f"graph of {nodes} nodes destroyed")

    engine_warm_up()
    meter.step("engine warm-up and shutdown (small Qwen3, FULL + 4-step graphs)")
    meter.step("limits after the engine", **limits())
    trials = (("CU_LIMIT_STACK_SIZE", 1024), ("CU_LIMIT_STACK_SIZE", 0),
              ("CU_LIMIT_MALLOC_HEAP_SIZE", 0), ("CU_LIMIT_PRINTF_FIFO_SIZE", 0))  # fmt: skip
    for name, value in trials:
        try:
            set_limit(name, value)
            meter.step(f"cuCtxSetLimit({name}, {value})", **limits())
        except Exception as error:  # a limit the driver refuses: reported, the rest still run
            rec.emit(case="set_limit_failed", limit=name, value=value, error=str(error))
    x.fill_(2.0)
    a @ w
    meter.step("a torch kernel and a GEMM after the limits were set", **limits())


if __name__ == "__main__":
    main()
