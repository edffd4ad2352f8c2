"""``benchmarks/ipc_host.py`` runs on the CPU: its buckets, pickled as a trainer's CUDA buckets,
write the values ``load_weights`` would, each bucket layout's plan is built once for every
refit, a bucket in the model's order is one copy, each layout's metadata is read once, and
every share's counter is released once; through a CPU engine's ``LLM`` too."""

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
    torch_path = {f"torch path: {stage}" for stage in ipc_host.TORCH_PATH}
    engine = {"llm call", "llm call cpu"}
    assert set(stages) == {*ipc_host.STAGES, "call", "call cpu", *held, *torch_path, *engine}
    # every timed bucket once: one refit of two timed its stages, the other its whole calls
    assert all(stages[s]["buckets"] == 30 for s in (*ipc_host.STAGES, "call", "call cpu"))
    # the engine's calls: every bucket of the timed refits, its weights written, none stale
    assert all(stages[s]["buckets"] == 2 * 30 for s in engine)
    llm = next(row for row in rows if row["case"] == "ipc host engine")
    assert llm["verified"] and llm["stale_weights"] == 0
    assert llm["handles_opened"] == 3 and llm["handles_reused"] == 3 * 30 - 3
    assert all(stages[s]["buckets"] == 2 * 30 for s in torch_path)
    assert setup["skeleton_misses"] == 30 and setup["skeleton_hits"] == 2 * 30


def test_its_engine_is_built_on_the_cpu_where_a_gpu_is_visible() -> None:
    """Regression: on the H200 (2026-12-06, run 1) the engine's ``device="auto"`` took the GPU,
    and checking its weights against the CPU model raised (cuda:0 against cpu)."""
    from benchmarks.ipc_host_parts import StandInDriver, engine_receiving_from
    from dormant.models import ModelConfig

    driver = StandInDriver(1 << 20)
    llm, _ = engine_receiving_from(driver, ModelConfig.from_dict(ipc_host.SMALL))
    try:
        assert llm.llm_engine.config.device == "cpu"
    finally:
        llm.shutdown()
        driver.close()
