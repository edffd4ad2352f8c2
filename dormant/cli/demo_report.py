"""The demo's report: per-step bytes by tag, times against the copy limit, checks, timeline."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dormant.memory import MemoryStatus, SleepReport, WakeReport

MiB = float(1 << 20)
Step = tuple[str, MemoryStatus, MemoryStatus, SleepReport | WakeReport | None]


@dataclass
class Timeline:
    """Snapshots of device memory by owner, for the report and the plot."""

    start: float = field(default_factory=time.perf_counter)
    points: list[tuple[float, str, dict[str, int]]] = field(default_factory=list)

    def mark(self, label: str, status: MemoryStatus, trainer_bytes: int = 0) -> None:
        by_owner = {t.tag: t.mapped_bytes for t in status.tags}
        by_owner["trainer"] = trainer_bytes
        by_owner["device in use"] = status.device_used_bytes
        self.points.append((time.perf_counter() - self.start, label, by_owner))


def copy_limits(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Measured bandwidth (GB/s) of a plain copy of ``nbytes``: pinned D2H/H2D on a GPU, memcpy
    on the CPU (where the host backend's copies are memcpy too)."""
    if device.type != "cuda":
        nbytes = 256 << 20
        a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        b.copy_(a)
        start = time.perf_counter()
        b.copy_(a)
        rate = nbytes / (time.perf_counter() - start) / 1e9
        return {"d2h": rate, "h2d": rate, "on_host": 1.0}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates[name] = nbytes / (time.perf_counter() - start) / 1e9
    return rates


def print_report(
    steps: list[Step],
    limits: dict[str, float],
    refit: tuple[float, int],
    checks: dict[str, bool],
    timeline: Timeline,
    png: str,
) -> None:
    if limits.get("on_host"):
        measured = f"host memory copy (memcpy) {limits['d2h']:.1f} GB/s"
    else:
        measured = f"D2H {limits['d2h']:.1f} GB/s, H2D {limits['h2d']:.1f} GB/s (pinned)"
    print(
        f"\ncopy limit measured here: {measured}"
        "\n'x limit' = the step's time / the time a plain copy of the same bytes takes at that"
        " limit (1.00: as fast as a copy can be; 2.00: twice as slow). It is shown for steps"
        " that copy at least 16 MiB; the first sleep also sets up the pinned host arena, once.\n"
    )
    header = (
        f"{'step':<24}{'time ms':>9}{'copied MiB':>12}{'GB/s':>7}{'x limit':>9}   memory by tag"
    )
    print(header)
    print("-" * len(header))
    for name, before, after, report in steps:
        seconds = report.total_s if report is not None else 0.0
        copied = report.bytes_copied if report is not None else 0
        limit = limits["d2h" if name.startswith("sleep") else "h2d"]
        # A ratio to the copy limit means something only when the step is mostly a copy.
        is_copy = copied >= 16 << 20
        ratio = f"{seconds / (copied / limit / 1e9):>9.2f}" if is_copy else f"{'-':>9}"
        rate = copied / seconds / 1e9 if copied and seconds else 0.0
        changes = []
        for tag in before.tags:
            delta = after.tag(tag.tag).mapped_bytes - tag.mapped_bytes
            if delta:
                verb = "restored" if delta > 0 else "freed"
                changes.append(f"{tag.tag} {verb} {abs(delta) / MiB:.1f} MiB")
        print(
            f"{name:<24}{seconds * 1e3:>9.1f}{copied / MiB:>12.1f}{rate:>7.1f}"
            f"{ratio}   {', '.join(changes) or '-'}"
        )
    refit_s, refit_bytes = refit
    print(
        f"{'update_weights(...)':<24}{refit_s * 1e3:>9.1f}{refit_bytes / MiB:>12.1f}"
        f"{refit_bytes / refit_s / 1e9:>7.1f}{'':>9}   weights rewritten in place"
    )
    print()
    for label, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {label}")
    print(f"\nmemory timeline: {plot_timeline(timeline, png)}")


def plot_timeline(timeline: Timeline, png: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not written (pip install matplotlib)"
    owners = ["weights", "kv_cache", "runtime", "cuda_graph", "workspace", "trainer"]
    xs = list(range(len(timeline.points)))
    series = [[p[2].get(o, 0) / 2**30 for p in timeline.points] for o in owners]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.stackplot(xs, series, labels=owners, step="mid", alpha=0.85)
    ax.set_xticks(xs, [p[1] for p in timeline.points], rotation=30, ha="right")
    ax.set_ylabel("GiB on the device")
    ax.set_title("dormant demo: device memory by owner through an RL cycle")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
