"""Every level-1 wake of the 8B-like engine's weights against the pinned H2D limit of the same
run (issue 17, section 3), one JSON line per wake.

Sequence per pass: level 1, level 2 (wake the weights, ``reload_weights``, wake the rest),
level 1, level 1; each level-1 row says how its wake split into map and copy, and what the sleep
before it did (copied, released, how long it took), so the rows show whether a slow wake follows
a sleep that copied nothing and released tens of GB just before (the cause that the CPU shape
test, tests/memory/test_engine_wake_shape.py, leaves: the layer's allocations, handles, arena
regions and copies are the same in every level-1 wake). Passes:

  gap 0 s       wakes right after the sleep, as benchmarks/decode.py and spec_decode.py do
  gap 1 s       a trainer step between sleep and wake, as in an RL loop
  gap 0 s, refit  every weight changed (one element each, in place) before each later level-1
                  sleep, so those sleeps copy, as after a real refit

The limit: a pinned host-to-device copy of the bytes the wake restores (weights + runtime), and
the same size with no release before it, timed in this process before the engine sleeps.

Usage: python benchmarks/engine_wake.py [--out results.jsonl] [--gaps 0,1] [--no-refit-pass]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table, timed
from benchmarks.decode import QWEN3_8B_LIKE
from dormant import LLM
from dormant.models import ModelConfig

LEVELS = (1, 2, 1, 1)


def h2d_limit_s(nbytes: int) -> float:
    """The median of three pinned host-to-device copies of ``nbytes``."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = [timed(lambda: device.copy_(host, non_blocking=True))[0] for _ in range(3)]
    return statistics.median(times)


def refit_changed(llm: LLM) -> None:
    """Changes one element of every weight in place, as a refit changes them all (the sleep's
    content hash then finds every weight changed, so it copies them)."""
    with torch.no_grad():
        for param in llm.llm_engine.executor.worker.model.parameters():
            param.view(-1)[0] += 1


def run_pass(rec: Recorder, llm: LLM, limit: float, gap: float, refit: bool) -> list[dict]:
    rows = []
    for index, level in enumerate(LEVELS):
        if refit and level == 1 and index:
            refit_changed(llm)
        sleep_wall, _ = timed(lambda lv=level: llm.sleep(level=lv))
        sleep = llm.memory_status()[0].last_sleep
        time.sleep(gap)
        wall, _ = timed(lambda: llm.wake_up(["weights"]))
        wake = llm.memory_status()[0].last_wake
        if level == 2:
            llm.reload_weights()
        llm.wake_up(["kv_cache"])
        if level != 1:
            continue
        rows.append(rec.emit(
            case="engine level-1 wake of the weights", run=f"gap {gap} s" + (", refit" if refit
            else ""), cycle=index, after_level_2=2 in LEVELS[:index], gap_s=gap,
            wake_s=wake.total_s, wake_wall_s=wall, x_limit=wake.total_s / limit, limit_s=limit,
            map_s=wake.map_s, copy_s=wake.copy_s, wake_copied=wake.bytes_copied,
            sleep_s=sleep.total_s,
            sleep_wall_s=sleep_wall, sleep_copied=sleep.bytes_copied,
            sleep_released=sleep.bytes_released, sleep_release_s=sleep.release_s,
            sleep_discard_s=sleep.discard_s, is_met=wake.total_s <= 1.1 * limit,
        ))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--gaps", default="0,1", help="seconds between sleep and wake, per pass")
    parser.add_argument("--no-refit-pass", action="store_true")
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    llm = LLM(ModelConfig.from_dict(QWEN3_8B_LIKE), max_model_len=4096, max_num_seqs=64,
              gpu_memory_utilization=0.6)  # fmt: skip
    worker = llm.llm_engine.executor.worker
    llm.sleep(level=1)  # places the arena regions; every row below is a steady-state cycle
    llm.wake_up()
    restored = llm.memory_status()[0].last_wake.bytes_copied
    limit = h2d_limit_s(restored)
    torch.cuda.empty_cache()
    weights = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    rec.emit(case="limit", op="h2d pinned", nbytes=restored, weight_bytes=weights, median_s=limit)
    passes = [(float(g), False) for g in args.gaps.split(",")]
    if not args.no_refit_pass:
        passes.append((0.0, True))
    rows = []
    for gap, refit in passes:
        rows += run_pass(rec, llm, limit, gap, refit)
    llm.shutdown()
    print(table(rows, ["run", "cycle", "after_level_2", "wake_s", "x_limit", "map_s", "copy_s",
                       "sleep_s", "sleep_copied", "sleep_released", "is_met"]))  # fmt: skip


if __name__ == "__main__":
    main()
