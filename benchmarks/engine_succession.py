"""Engines made one after another in one process, each while the last (shut down) is still bound
to a name, as ``benchmarks/spec_decode.py`` makes them: does ``shutdown()`` give the device back?

For each of spec_decode's cases (the 8B-like target; no draft, itself as the draft, a 0.6B-like
draft; with and without the fused rounds, eager), in that order: make the engine
(``gpu_memory_utilization=0.8``), decode a few tokens, optionally run a level-1 and a level-2
cycle (``--cycles``), shut it down, and read the device's free memory with the engine object
still alive, then again after dropping it. Prints one JSON line per engine: its KV blocks and
both readings. An engine that keeps memory after ``shutdown`` shows as "kept" bytes, and the next
engine gets fewer KV blocks than the same case would on an empty device.

    python benchmarks/engine_succession.py [--out results.jsonl] [--cycles]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import GiB, Recorder, environment
from benchmarks.decode import QWEN3_8B_LIKE
from benchmarks.spec_decode import QWEN3_0_6B_LIKE, decode_tokens_per_s, make_engine
from dormant import LLM


def free_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def cycle(llm: LLM) -> None:
    llm.sleep(level=1)
    llm.wake_up()
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cycles", action="store_true", help="a level-1 and a level-2 cycle each")
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    cases = (("none", None, False, 4), ("self rounds", QWEN3_8B_LIKE, False, 4),
             ("self", QWEN3_8B_LIKE, False, 1), ("self eager", QWEN3_8B_LIKE, True, 1),
             ("small rounds", QWEN3_0_6B_LIKE, False, 4),
             ("small", QWEN3_0_6B_LIKE, False, 1))  # fmt: skip
    empty = free_bytes()
    llm = None
    for case, draft, eager, multi_steps in cases:
        before = free_bytes()  # the last engine, shut down, is still bound to ``llm``
        llm = make_engine(draft, 3, eager, multi_steps)
        blocks = llm.llm_engine.runtime.num_kv_blocks
        decode_tokens_per_s(llm, 512, 16, 1)
        if args.cycles:
            cycle(llm)
        llm.shutdown()
        after_shutdown = free_bytes()
        rec.emit(
            case=case, num_kv_blocks=blocks, free_before_GiB=before / GiB,
            kept_after_shutdown_GiB=(empty - after_shutdown) / GiB,
        )  # fmt: skip
    del llm
    rec.emit(case="all dropped", kept_GiB=(empty - free_bytes()) / GiB)


if __name__ == "__main__":
    main()
