"""``benchmarks/ipc_host.py`` runs on the CPU: its buckets, pickled as a trainer's CUDA buckets,
write the values ``load_weights`` would, each bucket layout's plan is built once for every
refit, and a bucket in the model's order is one copy."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import ipc_host


def test_the_ipc_host_benchmark_runs(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["ipc_host.py", "--refits", "2"])
    ipc_host.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    setup = next(row for row in rows if row["case"] == "ipc host setup")
    assert setup["verified"] and setup["copies_per_bucket"] == 1
    assert setup["plans_built"] == setup["buckets_per_refit"] == 30  # 36 layers in 512 MiB
    # one open per refit (3, the untimed first included), every other share's counter released
    assert setup["handles_opened"] == setup["shares_held"] == 3
    assert setup["counters_released"] == setup["handles_reused"] == 3 * 30 - 3
    stages = {row["stage"]: row for row in rows if row["case"] == "ipc host stage"}
    held = {"held rebuild, torch's", "held rebuild, ours"}
    assert set(stages) == {*ipc_host.STAGES, "call", "call cpu", *held}
    assert all(
        row["buckets"] == setup["buckets_per_refit"]
        for stage, row in stages.items()
        if stage not in held
    )
