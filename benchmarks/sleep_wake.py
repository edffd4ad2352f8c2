"""Sleep/wake benchmark: dormant against the pinned-copy limit and torch_memory_saver, one run.

Cases (BENCHMARKS.md, issue 17):
  - an 8B-like weight set (2 x 1 GiB + 128 matrices of 40/56 MiB + small norms, ~8 GiB, HOST)
    plus 32 GiB of KV cache (DISCARD), cycled with the weights changed before every sleep; the
    weights alone, changed (the level-1 sleep is at this when the KV release hides under the
    copies); the level-1 sleep once per ``DiscardOrder`` (``--discard-orders``), each row with
    the seconds inside the KV's unmap + release (``discard_s``) and the weights' (``release_s``);
  - the same with the weights unchanged since the last offload; the weights alone, unchanged
    (under the weights' slab rule: 7 handles, was 131), also with the hashes in 1 group (hash
    all, then release) and in 8 (release each group's handles while the next ones hash;
    ``--hash-groups``); 8 GiB in one allocation, unchanged (the floor: no per-handle cost);
  - the KV cache alone, discard and restore, dormant and torch_memory_saver interleaved round by
    round (each op after an idle gap, the first system alternating), medians, spread and the
    median of the per-round ratios;
  - the first-ever sleep: dormant with its arena prepared in the background at "start-up"
    (``prepare_arena``, as the engine does once its graphs are captured), against the steady state;
  - 8 GiB in one allocation, and the same bytes as 4096 x 2 MiB segments: 8192 torch tensors of
    1 MiB allocated inside ``mm.capture`` (torch's caching allocator serves them from 2 MiB
    segments, two each: the shape CUDA-graph pools and capture scopes produce), and inside a
    torch_memory_saver region for TMS (the same 4096 segments, one VMM handle each there).
torch_memory_saver 0.0.10 runs the same sizes in hook_mode="torch", with its default pinned backup
(allocated at every pause) and with retain_cpu_backup=True (kept across cycles).

Usage: python benchmarks/sleep_wake.py [--cycles 3] [--kv-rounds 8] [--out results.jsonl]
       [--skip-tms] [--kv-only] [--discard-orders "under copies,thread,..." | none]
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

from benchmarks.common import GiB, MiB, Recorder, environment, timed
from benchmarks.sleep_wake_report import phases, ratio_rows, summary
from dormant.memory import DiscardOrder, MemoryManager, offload

KV_BYTES = 32 * GiB
# Idle time between a sleep and the next wake: the trainer's step. Without it, a wake that follows
# a sleep that took a few milliseconds competes with the driver still scrubbing the memory just
# released (measured: 244 ms instead of 160 ms for 8 GiB; results/2026-11-29-sleep-wake-run2).
TRAINER_STEP_S = 0.25
SEGMENT_TENSOR_NUMEL = MiB // 2  # 1 MiB of bf16: torch puts two in each 2 MiB segment
NUM_SEGMENT_TENSORS = 8192


def weight_mix() -> list[int]:
    """Element counts (bf16) of an 8B-like weight set: ~8 GiB in 195 segments."""
    sizes = [GiB // 2, GiB // 2]  # embedding and LM head, 1 GiB each
    sizes += [(40 if i % 2 else 56) * MiB // 2 for i in range(128)]  # projection matrices
    sizes += [4096] * 65  # norms, 8 KiB each
    return sizes


def segment_tensors() -> list[torch.Tensor]:
    """8 GiB as 8192 bf16 tensors of 1 MiB from torch's allocator (4096 segments of 2 MiB)."""
    return [
        torch.empty(SEGMENT_TENSOR_NUMEL, dtype=torch.bfloat16, device="cuda")
        for _ in range(NUM_SEGMENT_TENSORS)
    ]


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


def cycle(rec: Recorder, mm: MemoryManager, case: str, request: dict, nbytes: int,
          cycles: int, tensors: list[torch.Tensor] | None, wake_tags=None) -> None:  # fmt: skip
    """``cycles`` sleeps with ``request`` (each after changing ``tensors``, if given), each wake
    after a trainer step; one series per op, with the median of each phase."""
    sleeps, wakes, sleep_reports, wake_reports = [], [], [], []
    for _ in range(cycles):
        if tensors is not None:
            perturb(tensors)
        s, report = timed(lambda: mm.sleep(tags=request))
        sleeps.append(s)
        sleep_reports.append(report)
        time.sleep(TRAINER_STEP_S)
        s, report = timed(lambda: mm.wake_up(wake_tags))
        wakes.append(s)
        wake_reports.append(report)
    rec.series(case, "dormant", "sleep", sleeps, nbytes, **phases(sleep_reports))
    rec.series(case, "dormant", "wake", wakes, nbytes, **phases(wake_reports))


def first_sleep(rec: Recorder, mm: MemoryManager, case: str, request: dict, nbytes: int) -> None:
    seconds, report = timed(lambda: mm.sleep(tags=request))
    rec.emit(case=case, system="dormant", op="sleep", nbytes=nbytes, median_s=seconds,
             s_per_gib=seconds / (nbytes / GiB), **phases([report]))  # fmt: skip
    time.sleep(TRAINER_STEP_S)
    seconds, report = timed(mm.wake_up)
    rec.emit(case=case, system="dormant", op="wake", nbytes=nbytes, median_s=seconds,
             **phases([report]))  # fmt: skip


def bench_dormant(
    rec: Recorder, cycles: int, orders: list[DiscardOrder], hash_groups: list[int]
) -> None:
    level1 = {"weights": "host", "kv_cache": "discard"}
    mm = MemoryManager("cuda")
    weights = [mm.empty((n,), torch.bfloat16, "weights") for n in weight_mix()]
    nbytes = sum(t.numel() * 2 for t in weights)
    tag = mm.status().tag("weights")  # the weights' slab rule (slab_rules.LONG_LIVED)
    rec.emit(case="8B weights layout", system="dormant", op="layout", nbytes=nbytes,
             median_s=0.0, handles=tag.num_allocations,
             slack_bytes=tag.reserved_bytes - tag.block_bytes)  # fmt: skip
    kv = mm.empty((KV_BYTES,), torch.uint8, "kv_cache")
    fill_random(weights)

    # Start-up: the engine prepares the arena once its memory exists, then serves a while.
    preparation = mm.prepare_arena(tags=level1)
    preparation.wait()
    rec.emit(case="arena preparation (background)", system="dormant", op="prepare",
             nbytes=preparation.nbytes, median_s=preparation.seconds,
             s_per_gib=preparation.seconds / (preparation.nbytes / GiB))  # fmt: skip
    first_sleep(rec, mm, "first sleep, arena prepared", level1, nbytes)
    cycle(rec, mm, "8B weights + 32G KV, changed", level1, nbytes, cycles, weights)
    cycle(rec, mm, "8B weights only, changed", {"weights": "host"}, nbytes, cycles, weights,
          ["weights"])  # fmt: skip
    default = mm.discard_order
    for order in orders:  # the same sleep, with the KV released at each place
        mm.discard_order = order
        cycle(rec, mm, f"8B weights + 32G KV, changed, discard {order.value}", level1, nbytes,
              cycles, weights)  # fmt: skip
    mm.discard_order = default
    cycle(rec, mm, "8B weights + 32G KV, unchanged", level1, nbytes, cycles, None)
    cycle(rec, mm, "8B weights only, unchanged", {"weights": "host"}, nbytes, cycles, None,
          ["weights"])  # fmt: skip
    default_groups = offload.HASH_GROUPS
    for groups in hash_groups:  # 1: hash everything, then release; more: release under hashing
        offload.HASH_GROUPS = groups
        cycle(rec, mm, f"8B weights only, unchanged, {groups} hash groups", {"weights": "host"},
              nbytes, cycles, None, ["weights"])  # fmt: skip
    offload.HASH_GROUPS = default_groups
    tag = mm.status().tag("weights")  # after the first sleep trimmed the slabs' tails
    rec.emit(case="8B weights layout, trimmed", system="dormant", op="layout", nbytes=nbytes,
             median_s=0.0, handles=tag.num_allocations,
             slack_bytes=tag.reserved_bytes - tag.block_bytes)  # fmt: skip
    del weights, kv
    gc.collect()

    mm.register_tag("one")
    one = [mm.empty((4 * GiB,), torch.bfloat16, "one")]
    fill_random(one)
    first_sleep(rec, mm, "first sleep, arena not prepared", {"one": "host"}, 8 * GiB)
    cycle(rec, mm, "8 GiB in one allocation, changed", {"one": "host"}, 8 * GiB, cycles, one)
    cycle(rec, mm, "8 GiB in one allocation, unchanged", {"one": "host"}, 8 * GiB, cycles, None)
    del one
    gc.collect()

    mm.register_tag("segments")
    with mm.capture("segments"):
        segments = segment_tensors()
    fill_random(segments)
    handles = len(list(mm._table.allocations(["segments"])))
    raw_blocks = sum(1 for r in mm._table.records() if r.tag == "segments")
    rec.emit(case="4096x2MiB layout", system="dormant", op="layout", nbytes=8 * GiB,
             median_s=0.0, torch_segments=raw_blocks, handles=handles)  # fmt: skip
    mm.sleep(tags={"segments": "host"})  # places the arena regions (reuses the freed arena)
    mm.wake_up()
    cycle(rec, mm, "4096x2MiB, changed", {"segments": "host"}, 8 * GiB, cycles, segments)
    print(mm.status().table(), flush=True)
    del segments
    gc.collect()
    mm.close()
    torch.cuda.empty_cache()


def bench_tms(rec: Recorder, cycles: int) -> None:
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = "torch"
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = [torch.empty((n,), dtype=torch.bfloat16, device="cuda") for n in weight_mix()]
    with tms.region(tag="kv_cache"):
        kv = torch.empty((KV_BYTES,), dtype=torch.uint8, device="cuda")
    before = len(torch.cuda.memory_snapshot())
    with tms.region(tag="segments", enable_cpu_backup=True):
        segments = segment_tensors()
    rec.emit(case="4096x2MiB layout", system="tms", op="layout", nbytes=8 * GiB, median_s=0.0,
             torch_segments=len(torch.cuda.memory_snapshot()) - before)  # fmt: skip
    fill_random(weights)
    fill_random(segments)
    nbytes = sum(t.numel() * 2 for t in weights)

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
        case = "first sleep, arena not prepared"
        rec.emit(case=case, system=system, op="sleep", nbytes=nbytes, median_s=s,
                 s_per_gib=s / (nbytes / GiB))  # fmt: skip
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
        for _ in range(cycles + 1):
            perturb(segments)
            seg_sleeps.append(timed(lambda: tms.pause("segments"))[0])
            time.sleep(TRAINER_STEP_S)
            seg_wakes.append(timed(lambda: tms.resume("segments"))[0])
        # The first cycle of each mode allocates its pinned backups: left out, as dormant's is.
        rec.series("4096x2MiB, changed", system, "sleep", seg_sleeps[1:], 8 * GiB)
        rec.series("4096x2MiB, changed", system, "wake", seg_wakes[1:], 8 * GiB)

    del weights, kv, segments


def bench_kv(rec: Recorder, rounds: int, with_tms: bool) -> None:
    """32 GiB of KV discarded and restored, dormant and TMS interleaved round by round: each op
    after an idle gap, the system going first alternating, so that drift in the driver's state
    reaches both. Rows: medians with min, max and the interquartile spread, and the median of
    the per-round ratios (dormant / TMS), which drift between rounds cancels out of."""
    mm = MemoryManager("cuda")
    kv = mm.empty((KV_BYTES,), torch.uint8, "kv_cache")
    systems = {"dormant": (lambda: mm.sleep(tags={"kv_cache": "discard"}),
                           lambda: mm.wake_up(["kv_cache"]))}  # fmt: skip
    if with_tms:
        from torch_memory_saver import torch_memory_saver as tms

        if getattr(tms, "_impl_ctor_kwargs", None) is not None:  # not yet initialised
            tms.hook_mode = "torch"  # (bench_tms may have initialised it: then it is set)
        with tms.region(tag="kv_bench"):
            tms_kv = torch.empty((KV_BYTES,), dtype=torch.uint8, device="cuda")
        systems["tms"] = (lambda: tms.pause("kv_bench"), lambda: tms.resume("kv_bench"))
    times: dict[tuple[str, str], list[float]] = {(n, op): [] for n in systems for op in OPS}
    for index in range(rounds + 1):  # the first round warms up both, and is left out
        names = list(systems) if index % 2 == 0 else list(reversed(systems))
        for name in names:
            for op, fn in zip(OPS, systems[name], strict=True):
                time.sleep(TRAINER_STEP_S)
                seconds = timed(fn)[0]
                if index:
                    times[(name, op)].append(seconds)
    for (name, op), samples in times.items():
        rec.series("32G KV discard", name, op, samples, KV_BYTES, **spread(samples))
    if with_tms:
        for op in OPS:
            paired = [
                d / t for d, t in zip(times[("dormant", op)], times[("tms", op)], strict=True)
            ]
            value = statistics.median(paired)
            rec.emit(case="ratio", name=f"KV {op}: dormant / TMS, per round", value=value,
                     min=min(paired), max=max(paired), target_at_most=1.0,
                     is_met=value <= 1.0)  # fmt: skip
        del tms_kv
    del kv
    mm.close()


OPS = ("sleep", "wake")


def spread(samples: list[float]) -> dict[str, float]:
    """The interquartile range, and it over the median (0.1: the middle half within 10 %)."""
    q1, _, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else (samples * 3)
    return {"iqr_s": q3 - q1, "iqr_over_median": (q3 - q1) / statistics.median(samples)}


def parse_orders(text: str) -> list[DiscardOrder]:
    if text == "none":
        return []
    return [DiscardOrder.parse(name.strip()) for name in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--kv-rounds", type=int, default=8)
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    parser.add_argument("--skip-tms", action="store_true")
    parser.add_argument("--kv-only", action="store_true", help="only the KV discard/restore")
    every_order = ",".join(o.value for o in DiscardOrder)
    parser.add_argument(
        "--discard-orders",
        default=every_order,
        help="DiscardOrder values to time the level-1 sleep with, or none",
    )
    parser.add_argument(
        "--hash-groups", default="1,8", help="HASH_GROUPS values for the unchanged weights row"
    )
    args = parser.parse_args()
    orders = parse_orders(args.discard_orders)
    hash_groups = [int(g) for g in args.hash_groups.split(",") if g]
    rec = Recorder(args.out)
    rec.emit(case="environment", **environment())
    limits = measure_limits(rec, 8 * GiB)
    if not args.kv_only:
        bench_dormant(rec, args.cycles, orders, hash_groups)
        if not args.skip_tms:
            bench_tms(rec, args.cycles)
    bench_kv(rec, args.kv_rounds, not args.skip_tms)
    for row in ratio_rows(rec.rows):
        rec.emit(**row)
    print(summary(rec, limits))


if __name__ == "__main__":
    main()
