"""Sleep/wake benchmark: dormant against the pinned-copy limit and torch_memory_saver, one run.

Cases (BENCHMARKS.md, issue "Foundation"):
  - an 8B-like weight set (2 x 1 GiB + 128 matrices of 40/56 MiB + small norms, ~8 GiB, HOST)
    plus 32 GiB of KV cache (DISCARD), cycled with the weights changed before every sleep;
  - the same with the weights unchanged since the last offload;
  - the KV cache alone (discard and restore);
  - 4096 x 2 MiB segments (8 GiB), the shape graph pools and caching allocators produce;
  - the first-ever sleep, host arena setup included.
torch_memory_saver 0.0.10 runs the same sizes in hook_mode="torch", with its default pinned backup
(allocated at every pause) and with retain_cpu_backup=True (kept across cycles).

Usage: python benchmarks/sleep_wake.py [--cycles 5] [--out results.jsonl] [--skip-tms]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import GiB, MiB, Recorder, environment, table, timed
from dormant.memory import MemoryManager

KV_BYTES = 32 * GiB
# Idle time between a sleep and the next wake: the trainer's step. Without it, a wake that follows
# a sleep that took a few milliseconds competes with the driver still scrubbing the memory just
# released (measured: 244 ms instead of 160 ms for 8 GiB; results/2026-11-29-sleep-wake-run2).
TRAINER_STEP_S = 0.25


def weight_mix() -> list[int]:
    """Element counts (bf16) of an 8B-like weight set: ~8 GiB in 195 segments."""
    sizes = [GiB // 2, GiB // 2]  # embedding and LM head, 1 GiB each
    sizes += [(40 if i % 2 else 56) * MiB // 2 for i in range(128)]  # projection matrices
    sizes += [4096] * 65  # norms, 8 KiB each
    return sizes


def small_segments() -> list[int]:
    return [MiB] * 4096  # 4096 x 2 MiB of bf16


def fill_random(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.normal_()


def perturb(tensors: list[torch.Tensor]) -> None:
    """Changes one element of every tensor, as a refit would change them all."""
    for t in tensors:
        t.view(-1)[0] += 1


def measure_limits(rec: Recorder, nbytes: int) -> dict[str, float]:
    """The physical limits, on the same bytes: pinned copies each way, and a device fill."""
    d2h, h2d = _pinned_copies(nbytes)
    rec.series("limit", "pinned copy", "d2h", d2h, nbytes)
    rec.series("limit", "pinned copy", "h2d", h2d, nbytes)
    rec.series("limit", "device fill", "fill", _device_fill(KV_BYTES), KV_BYTES)
    torch.cuda.empty_cache()
    return {
        "d2h_gbps": nbytes / statistics.median(d2h) / 1e9,
        "h2d_gbps": nbytes / statistics.median(h2d) / 1e9,
    }


def _pinned_copies(nbytes: int) -> tuple[list[float], list[float]]:
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(3)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = [timed(lambda: host.copy_(device, non_blocking=True))[0] for _ in range(3)]
    h2d = [timed(lambda: device.copy_(host, non_blocking=True))[0] for _ in range(3)]
    return d2h, h2d


def _device_fill(nbytes: int) -> list[float]:
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return [timed(lambda: buffer.fill_(1))[0] for _ in range(3)]


def bench_dormant(rec: Recorder, cycles: int) -> None:
    mm = MemoryManager("cuda")
    weights = [mm.empty((n,), torch.bfloat16, "weights") for n in weight_mix()]
    nbytes = sum(t.numel() * 2 for t in weights)
    kv = mm.empty((KV_BYTES,), torch.uint8, "kv_cache")
    fill_random(weights)

    seconds, report = timed(lambda: mm.sleep(level=1))
    rec.emit(
        case="first sleep",
        system="dormant",
        op="sleep",
        nbytes=nbytes,
        median_s=seconds,
        s_per_gib=seconds / (nbytes / GiB),
        **_phases([report]),
    )
    seconds, _ = timed(mm.wake_up)
    rec.emit(case="first sleep", system="dormant", op="wake", nbytes=nbytes, median_s=seconds)

    for changed in (True, False):
        sleeps, wakes, sleep_reports, wake_reports = [], [], [], []
        for _ in range(cycles):
            if changed:
                perturb(weights)
            s, report = timed(lambda: mm.sleep(level=1))
            sleeps.append(s)
            sleep_reports.append(report)
            time.sleep(TRAINER_STEP_S)
            s, report = timed(mm.wake_up)
            wakes.append(s)
            wake_reports.append(report)
        case = "8B weights + 32G KV, " + ("changed" if changed else "unchanged")
        rec.series(case, "dormant", "sleep", sleeps, nbytes, **_phases(sleep_reports))
        rec.series(case, "dormant", "wake", wakes, nbytes, **_phases(wake_reports))

    only_sleeps, only_reports = [], []
    for _ in range(cycles):  # the weights alone, unchanged: hash, skip the copy, release
        s, report = timed(lambda: mm.sleep(tags={"weights": "host"}))
        only_sleeps.append(s)
        only_reports.append(report)
        time.sleep(TRAINER_STEP_S)
        mm.wake_up()
    rec.series(
        "8B weights only, unchanged",
        "dormant",
        "sleep",
        only_sleeps,
        nbytes,
        **_phases(only_reports),
    )

    kv_sleeps, kv_wakes = [], []
    for _ in range(cycles * 2):
        kv_sleeps.append(timed(lambda: mm.sleep(tags={"kv_cache": "discard"}))[0])
        time.sleep(TRAINER_STEP_S)
        kv_wakes.append(timed(lambda: mm.wake_up(["kv_cache"]))[0])
    rec.series("32G KV discard", "dormant", "sleep", kv_sleeps, KV_BYTES)
    rec.series("32G KV discard", "dormant", "wake", kv_wakes, KV_BYTES)
    del weights, kv
    gc.collect()

    mm.register_tag("segments")
    segments = [mm.empty((n,), torch.bfloat16, "segments") for n in small_segments()]
    fill_random(segments)
    seg_bytes = sum(t.numel() * 2 for t in segments)
    s, report = timed(lambda: mm.sleep(tags={"segments": "host"}))
    rec.emit(
        case="4096x2MiB first sleep",
        system="dormant",
        op="sleep",
        nbytes=seg_bytes,
        median_s=s,
        s_per_gib=s / (seg_bytes / GiB),
        arena_s=report.arena_s,
    )
    mm.wake_up()
    sleeps, wakes = [], []
    for _ in range(cycles):
        perturb(segments)
        sleeps.append(timed(lambda: mm.sleep(tags={"segments": "host"}))[0])
        time.sleep(TRAINER_STEP_S)
        wakes.append(timed(mm.wake_up)[0])
    rec.series("4096x2MiB, changed", "dormant", "sleep", sleeps, seg_bytes)
    rec.series("4096x2MiB, changed", "dormant", "wake", wakes, seg_bytes)
    print(mm.status().table(), flush=True)
    del segments
    gc.collect()
    mm.close()
    torch.cuda.empty_cache()


def _phases(reports: list) -> dict[str, float]:
    """Median of each ``*_s`` phase over a series of sleep or wake reports."""
    names = [k for k in reports[0].__dict__ if k.endswith("_s") and k != "total_s"]
    return {k: statistics.median(getattr(r, k) for r in reports) for k in names}


def bench_tms(rec: Recorder, cycles: int) -> None:
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = [torch.empty((n,), dtype=torch.bfloat16, device="cuda") for n in weight_mix()]
    with tms.region(tag="kv_cache"):
        kv = torch.empty((KV_BYTES,), dtype=torch.uint8, device="cuda")
    with tms.region(tag="segments", enable_cpu_backup=True):
        segments = [
            torch.empty((n,), dtype=torch.bfloat16, device="cuda") for n in small_segments()
        ]
    fill_random(weights)
    fill_random(segments)
    nbytes = sum(t.numel() * 2 for t in weights)
    seg_bytes = sum(t.numel() * 2 for t in segments)

    def pause_level1() -> None:
        tms.pause("weights")
        tms.pause("kv_cache")

    def resume_all() -> None:
        tms.resume("weights")
        tms.resume("kv_cache")

    for retain in (False, True):
        system = "tms retain" if retain else "tms default"
        tms.retain_cpu_backup = retain
        s = timed(pause_level1)[0]
        rec.emit(
            case="first sleep",
            system=system,
            op="sleep",
            nbytes=nbytes,
            median_s=s,
            s_per_gib=s / (nbytes / GiB),
        )
        timed(resume_all)
        sleeps, wakes = [], []
        for _ in range(cycles):
            perturb(weights)
            sleeps.append(timed(pause_level1)[0])
            time.sleep(TRAINER_STEP_S)
            wakes.append(timed(resume_all)[0])
        rec.series("8B weights + 32G KV, changed", system, "sleep", sleeps, nbytes)
        rec.series("8B weights + 32G KV, changed", system, "wake", wakes, nbytes)
        seg_sleeps, seg_wakes = [], []
        for _ in range(min(cycles, 3)):
            perturb(segments)
            seg_sleeps.append(timed(lambda: tms.pause("segments"))[0])
            time.sleep(TRAINER_STEP_S)
            seg_wakes.append(timed(lambda: tms.resume("segments"))[0])
        rec.series("4096x2MiB, changed", system, "sleep", seg_sleeps, seg_bytes)
        rec.series("4096x2MiB, changed", system, "wake", seg_wakes, seg_bytes)

    kv_sleeps, kv_wakes = [], []
    for _ in range(cycles * 2):
        kv_sleeps.append(timed(lambda: tms.pause("kv_cache"))[0])
        time.sleep(TRAINER_STEP_S)
        kv_wakes.append(timed(lambda: tms.resume("kv_cache"))[0])
    rec.series("32G KV discard", "tms", "sleep", kv_sleeps, KV_BYTES)
    rec.series("32G KV discard", "tms", "wake", kv_wakes, KV_BYTES)
    del weights, kv, segments


def summary(rec: Recorder, limits: dict[str, float]) -> str:
    rows = []
    by_key = {(r["case"], r["system"], r["op"]): r for r in rec.rows if "system" in r}
    for (case, system, op), r in by_key.items():
        if case == "limit":
            continue
        row = {
            "case": case,
            "system": system,
            "op": op,
            "median_ms": r["median_s"] * 1e3,
            "min_ms": r.get("min_s", r["median_s"]) * 1e3,
            "max_ms": r.get("max_s", r["median_s"]) * 1e3,
        }
        bandwidth = limits["d2h_gbps"] if op == "sleep" else limits["h2d_gbps"]
        if not case.startswith("32G KV"):  # the KV-only cases copy nothing: no copy limit
            row["x_limit"] = r["median_s"] / (r["nbytes"] / bandwidth / 1e9)
        peer = by_key.get((case, "dormant", op))
        if system != "dormant" and peer is not None:
            row["peer_over_dormant"] = r["median_s"] / peer["median_s"]
        rows.append(row)
    columns = [
        "case",
        "system",
        "op",
        "median_ms",
        "min_ms",
        "max_ms",
        "x_limit",
        "peer_over_dormant",
    ]
    return table(rows, columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    parser.add_argument("--skip-tms", action="store_true")
    args = parser.parse_args()
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    limits = measure_limits(rec, 8 * GiB)
    bench_dormant(rec, args.cycles)
    if not args.skip_tms:
        bench_tms(rec, args.cycles)
    print(summary(rec, limits))


if __name__ == "__main__":
    main()
