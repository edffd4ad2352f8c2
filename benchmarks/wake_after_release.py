"""Why the 8B-like engine's level-1 wake of its weights took 1.6-1.8 x the copy limit in the
cycles after a level-2 cycle, and 1.1 x the first time (issue 17, section 3;
results/2026-11-29-decode-split-kv.jsonl).

What differs between those cycles, from that file: the slow wakes follow a level-1 sleep that
copied nothing (the refit after level 2 wrote the same bytes, so every weight matched its arena
copy) and released 75.7 GB in 49-70 ms; the fast one followed a sleep that copied 16.6 GB and
took 2.95 s. ``benchmarks/decode.py`` wakes right after the sleep, with no trainer step between.

Hypothesis: a wake that starts right after a sleep released tens of GB competes with the driver
still reclaiming that memory (cuMemCreate handing out pages not yet scrubbed, or the scrub using
the copy engines the H2D copies need). sleep_wake.py saw the same in a smaller form (244 ms
instead of 160 ms for 8 GiB without the idle gap, results/2026-11-29-sleep-wake-run2).

This probe holds the engine's shapes in a MemoryManager (16 GiB of weights in the 8B-like mix,
56 GiB of KV) and times the wake of the weights (its map and copy phases apart) after:

  case                                   predicts, if the hypothesis holds
  unchanged level-1 sleep, gap g         slow at g = 0, at the limit for g >= ~1 s
  changed level-1 sleep (copies), gap 0  near the limit: the release finished under the copy
  unchanged, skip_unchanged=False, gap 0 the same (it copies; no hash skip)
  unchanged weights-only sleep, gap 0    between: only the weights' 16 GiB were released
  weights asleep long ago, KV released   slow: the release of the KV alone, just before
  right before the wake, gap 0

``--engine`` also runs the engine itself (decode.py's cycle: levels 1, 2, 1, 2, 1, reload after
level 2) twice: waking at once, as decode.py does, and after a 1 s gap.

``--copy-path`` runs every case with the wake's copy path forced to a mode (dormant.memory's
``CopyPathPolicy``; ``all``: auto, copy_engine, sm and hybrid in turn, cycle by cycle), and each
row says which path ran and the bytes each carried: the wake right after a large release by each
path, against the limit. ``--gaps`` picks the idle gaps of the unchanged level-1 case.

Usage: python benchmarks/wake_after_release.py [--out results.jsonl] [--engine] [--repeats 3]
       [--copy-path auto|copy_engine|sm|hybrid|all] [--gaps 0,0.05,0.25,1,3]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import GiB, MiB, Recorder, environment, table, timed
from dormant.memory import CopyMode, CopyPathPolicy, MemoryManager, WakeReport

KV_BYTES = 56 * GiB
GAPS_S = (0.0, 0.05, 0.25, 1.0, 3.0)
LEVEL1 = {"weights": "host", "kv_cache": "discard"}


def weight_mix_16g() -> list[int]:
    """bf16 element counts: 2 x 1.16 GiB (embedding, LM head) + 252 matrices, ~16 GiB."""
    sizes = [151936 * 4096] * 2
    sizes += [(40 if i % 2 else 56) * MiB // 2 for i in range(252)]
    return sizes + [4096] * 145


def h2d_limit_s(nbytes: int) -> float:
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return statistics.median(
        timed(lambda: device.copy_(host, non_blocking=True))[0] for _ in range(3)
    )


def path_fields(mode: CopyMode, report: WakeReport) -> dict:
    """What a row says about the copy path: the mode asked for, the path that ran, its bytes."""
    return dict(
        mode=mode.value, copy_path=None if report.copy_path is None else report.copy_path.value,
        bytes_sm=report.bytes_sm, bytes_copy_engine=report.bytes_copy_engine,
        recent_release_bytes=report.recent_release_bytes,
    )  # fmt: skip


def wake_row(rec: Recorder, case: str, gap: float, sleep, mm: MemoryManager, limit: float) -> dict:
    """Sleeps with ``sleep()``, idles ``gap`` s, wakes the weights; then wakes the rest."""
    slept, sleep_report = timed(sleep)
    time.sleep(gap)
    woke, report = timed(lambda: mm.wake_up(["weights"]))
    mm.wake_up()
    return rec.emit(
        case=case, gap_s=gap, wake_s=woke, x_limit=woke / limit, map_s=report.map_s,
        copy_s=report.copy_s, bytes_copied=report.bytes_copied, sleep_s=slept,
        sleep_released=sleep_report.bytes_released, sleep_copied=sleep_report.bytes_copied,
        **path_fields(mm.copy_policy.mode, report),
    )  # fmt: skip


def probe_layer(rec: Recorder, repeats: int, modes: list[CopyMode], gaps: list[float]) -> list:
    mm = MemoryManager("cuda")
    weights = [mm.empty((n,), torch.bfloat16, "weights") for n in weight_mix_16g()]
    kv = mm.empty((KV_BYTES,), torch.uint8, "kv_cache")
    for t in weights:
        t.normal_()
    nbytes = sum(t.numel() * 2 for t in weights)
    limit = h2d_limit_s(nbytes)
    torch.cuda.empty_cache()
    rec.emit(case="limit", op="h2d", nbytes=nbytes, median_s=limit)
    mm.copy_policy = CopyPathPolicy(mode=modes[0])
    rows = [wake_row(rec, "first level-1 sleep (copies)", 0.0, lambda: mm.sleep(level=1), mm,
                     limit)]  # fmt: skip
    for _ in range(repeats):
        for mode in modes:
            mm.copy_policy = CopyPathPolicy(mode=mode)
            rows += layer_cycle(rec, mm, weights, limit, gaps)
    weights.clear()
    del kv
    gc.collect()
    mm.close()
    torch.cuda.empty_cache()
    return rows


def layer_cycle(rec: Recorder, mm: MemoryManager, weights: list[torch.Tensor], limit: float,
                gaps: list[float]) -> list[dict]:  # fmt: skip
    """Every case once, under ``mm``'s copy policy."""
    rows = []
    for gap in gaps:
        rows.append(wake_row(rec, "unchanged level-1 sleep", gap,
                             lambda: mm.sleep(tags=LEVEL1), mm, limit))  # fmt: skip

    def refit_then_sleep() -> object:  # every weight changes, as a refit changes them
        for t in weights:
            t.view(-1)[0].add_(1)
        return mm.sleep(tags=LEVEL1)

    rows.append(wake_row(rec, "changed level-1 sleep (copies)", 0.0, refit_then_sleep, mm,
                         limit))  # fmt: skip
    rows.append(wake_row(rec, "unchanged weights-only sleep", 0.0,
                         lambda: mm.sleep(tags={"weights": "host"}), mm, limit))  # fmt: skip

    def weights_long_ago_then_kv() -> object:
        mm.sleep(tags={"weights": "host"})
        time.sleep(2.0)
        return mm.sleep(tags={"kv_cache": "discard"})

    rows.append(wake_row(rec, "weights asleep 2 s, KV released just before", 0.0,
                         weights_long_ago_then_kv, mm, limit))  # fmt: skip
    mm.skip_unchanged = False
    rows.append(wake_row(rec, "unchanged, skip_unchanged=False (copies)", 0.0,
                         lambda: mm.sleep(tags=LEVEL1), mm, limit))  # fmt: skip
    mm.skip_unchanged = True
    mm.sleep(tags=LEVEL1)  # copies once more: without a digest no copy could be skipped
    mm.wake_up()
    return rows


def probe_engine(rec: Recorder, modes: list[CopyMode]) -> list[dict]:
    from benchmarks.decode import QWEN3_8B_LIKE
    from dormant import LLM
    from dormant.models import ModelConfig

    llm = LLM(ModelConfig.from_dict(QWEN3_8B_LIKE), max_model_len=4096, max_num_seqs=64,
              gpu_memory_utilization=0.6)  # fmt: skip
    worker = llm.llm_engine.executor.worker
    nbytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    limit = h2d_limit_s(nbytes)
    torch.cuda.empty_cache()
    rows = []
    for gap, mode in itertools.product((0.0, 1.0), modes):
        worker.mm.copy_policy = CopyPathPolicy(mode=mode)
        for index, level in enumerate((1, 2, 1, 2, 1)):
            llm.sleep(level=level)
            sleep = llm.memory_status()[0].last_sleep
            time.sleep(gap)
            llm.wake_up(["weights"])
            wake = llm.memory_status()[0].last_wake
            if level == 2:
                llm.reload_weights()
            llm.wake_up(["kv_cache"])
            if level == 1:
                rows.append(rec.emit(
                    case="engine level-1 wake of the weights", gap_s=gap, cycle=index,
                    wake_s=wake.total_s, x_limit=wake.total_s / limit, map_s=wake.map_s,
                    copy_s=wake.copy_s, sleep_s=sleep.total_s, sleep_copied=sleep.bytes_copied,
                    sleep_released=sleep.bytes_released, **path_fields(mode, wake),
                ))  # fmt: skip
    llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", action="store_true", help="also run the 8B-like engine")
    parser.add_argument(
        "--copy-path",
        default="auto",
        choices=[*(m.value for m in CopyMode), "all"],
        help="the wake's copy mode for every case, or all of them in turn",
    )
    parser.add_argument(
        "--gaps",
        type=lambda text: [float(g) for g in text.split(",")],
        default=list(GAPS_S),
        help="idle gaps (s) of the unchanged level-1 case, comma-separated",
    )
    args = parser.parse_args()
    modes = list(CopyMode) if args.copy_path == "all" else [CopyMode.parse(args.copy_path)]
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    rows = probe_layer(rec, args.repeats, modes, args.gaps)
    if args.engine:
        rows += probe_engine(rec, modes)
    print(table(summarize(rec, rows), ["case", "gap_s", "mode", "path", "n", "wake_ms",
                                       "x_limit", "map_ms", "sleep_ms"]))  # fmt: skip


def summarize(rec: Recorder, rows: list[dict]) -> list[dict]:
    """Medians by case, gap and mode (with the paths that ran), each also emitted."""
    groups: dict[tuple[str, float, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["gap_s"], row["mode"]), []).append(row)
    summary = [
        {"case": case, "gap_s": gap, "mode": mode,
         "path": "/".join(sorted({str(r["copy_path"]) for r in rs})), "n": len(rs),
         "wake_ms": statistics.median(r["wake_s"] for r in rs) * 1e3,
         "x_limit": statistics.median(r["x_limit"] for r in rs),
         "map_ms": statistics.median(r["map_s"] for r in rs) * 1e3,
         "sleep_ms": statistics.median(r["sleep_s"] for r in rs) * 1e3}
        for (case, gap, mode), rs in groups.items()
    ]  # fmt: skip
    for row in summary:
        rec.emit(case="summary", **{k if k != "case" else "of": v for k, v in row.items()})
    return summary


if __name__ == "__main__":
    main()
