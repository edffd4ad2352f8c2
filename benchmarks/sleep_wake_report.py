"""The summary of ``sleep_wake.py``: the table of every row, and the ratios issue 17 sets
targets on, computed from rows of the same run."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import Recorder, table

# (name, numerator (case, system, op), denominator (case, system, op), target: at most)
RATIOS = [
    ("first sleep / steady sleep",
     ("first sleep, arena prepared", "dormant", "sleep"),
     ("8B weights + 32G KV, changed", "dormant", "sleep"), 1.2),
    ("4096x2MiB sleep / one allocation",
     ("4096x2MiB, changed", "dormant", "sleep"),
     ("8 GiB in one allocation, changed", "dormant", "sleep"), 1.1),
    ("4096x2MiB wake / one allocation",
     ("4096x2MiB, changed", "dormant", "wake"),
     ("8 GiB in one allocation, changed", "dormant", "wake"), 1.1),
    ("4096x2MiB sleep: dormant / TMS retain",
     ("4096x2MiB, changed", "dormant", "sleep"),
     ("4096x2MiB, changed", "tms retain", "sleep"), 1.0),
    ("4096x2MiB wake: dormant / TMS retain",
     ("4096x2MiB, changed", "dormant", "wake"),
     ("4096x2MiB, changed", "tms retain", "wake"), 1.0),
    ("KV discard: dormant / TMS",
     ("32G KV discard", "dormant", "sleep"), ("32G KV discard", "tms", "sleep"), 1.0),
    ("KV restore: dormant / TMS",
     ("32G KV discard", "dormant", "wake"), ("32G KV discard", "tms", "wake"), 1.0),
    ("level-1 sleep: dormant / TMS retain",
     ("8B weights + 32G KV, changed", "dormant", "sleep"),
     ("8B weights + 32G KV, changed", "tms retain", "sleep"), 1.0),
    ("level-1 sleep / the weights alone (1.0: the KV release hidden)",
     ("8B weights + 32G KV, changed", "dormant", "sleep"),
     ("8B weights only, changed", "dormant", "sleep"), 1.02),
    ("level-1 wake: dormant / TMS retain",
     ("8B weights + 32G KV, changed", "dormant", "wake"),
     ("8B weights + 32G KV, changed", "tms retain", "wake"), 1.0),
]  # fmt: skip
UNCHANGED_TARGET_S = 0.010  # the 8 GiB of weights alone, unchanged


def phases(reports: list) -> dict[str, float]:
    """Median of each ``*_s`` phase over a series of sleep or wake reports."""
    names = [k for k in reports[0].__dict__ if k.endswith("_s") and k != "total_s"]
    return {k: statistics.median(getattr(r, k) for r in reports) for k in names}


def ratio_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ratio whose two rows were both measured, and the unchanged-weights target."""
    by_key = {(r["case"], r.get("system"), r.get("op")): r for r in rows}
    out = []
    for name, top, bottom, target in RATIOS:
        if top in by_key and bottom in by_key:
            value = by_key[top]["median_s"] / by_key[bottom]["median_s"]
            out.append({"case": "ratio", "name": name, "value": value, "target_at_most": target,
                        "is_met": value <= target})  # fmt: skip
    unchanged = by_key.get(("8B weights only, unchanged", "dormant", "sleep"))
    if unchanged is not None:
        value = unchanged["median_s"]
        out.append(
            {
                "case": "ratio",
                "name": "unchanged 8 GiB weights sleep (s)",
                "value": value,
                "target_at_most": UNCHANGED_TARGET_S,
                "is_met": value <= UNCHANGED_TARGET_S,
            }
        )
    return out


def summary(rec: Recorder, limits: dict[str, float]) -> str:
    rows = []
    by_key = {(r["case"], r["system"], r["op"]): r for r in rec.rows if "system" in r}
    for (case, system, op), r in by_key.items():
        if case == "limit" or op in ("layout", "prepare"):
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
        if not case.startswith("32G KV") and "unchanged" not in case:  # these copy nothing
            row["x_limit"] = r["median_s"] / (r["nbytes"] / bandwidth / 1e9)
        peer = by_key.get((case, "dormant", op))
        if system != "dormant" and peer is not None:
            row["peer_over_dormant"] = r["median_s"] / peer["median_s"]
        rows.append(row)
    columns = ["case", "system", "op", "median_ms", "min_ms", "max_ms", "x_limit",
               "peer_over_dormant"]  # fmt: skip
    ratios = [r for r in rec.rows if r.get("case") == "ratio"]
    ratio_table = table(ratios, ["name", "value", "target_at_most", "is_met"]) if ratios else ""
    return table(rows, columns) + "\n\n" + ratio_table
