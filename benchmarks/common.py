"""Shared benchmark plumbing: timing on the GPU, JSON lines, summaries and the final table."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

GiB = 1 << 30
MiB = 1 << 20


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of ``fn()`` with the device idle before and after (so async work is counted)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


@dataclass
class Recorder:
    """Prints one JSON line per measurement and keeps them for the summary table."""

    path: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)

    def emit(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        line = json.dumps(row, sort_keys=True)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        return row

    def series(
        self, case: str, system: str, op: str, seconds: list[float], nbytes: int, **extra: Any
    ) -> dict[str, Any]:
        return self.emit(
            case=case,
            system=system,
            op=op,
            nbytes=nbytes,
            median_s=statistics.median(seconds),
            min_s=min(seconds),
            max_s=max(seconds),
            samples=len(seconds),
            gbps=nbytes / statistics.median(seconds) / 1e9,
            **extra,
        )


def environment() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    driver = "unknown"
    try:
        import subprocess

        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        pass
    return {
        "gpu": props.name,
        "driver": driver,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    for row in rows:
        lines.append(
            "  ".join(_fmt(row.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True))
        )
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
