"""``benchmarks/tp_scenario.py`` (issue 20's scenario) runs on the CPU at TP=2 over gloo: a MoE
with self-speculation through two cycles (levels 2 and 1), the tokens and the acceptance rate
unchanged (a moved guarded address would raise), every checked generate made on the prefix
cache a cycle leaves (a reference made on an empty cache compared other prefills on the GPU, in
bf16: 2026-12-06b run 1), and one row per rank and cycle."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import tp_scenario


def test_the_tp_scenario_runs_at_tp2_on_the_cpu(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    argv = ["tp_scenario.py", "--tiny", "--cycles", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    tp_scenario.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    setup = next(row for row in rows if row["case"] == "setup")
    assert setup["tp"] == 2 and setup["architecture"] == "Qwen3MoeForCausalLM"
    control = next(row for row in rows if row["case"] == "control")
    assert control["control_equal"] and control["cold_equal"]  # fp32 on the CPU: hits = misses
    # Every checked generate ran on the cache a cycle leaves, the reference's too (the prompts'
    # full blocks, cached by the one-token first decode); an empty cache holds none.
    assert control["cached_tokens"] > 0 and control["cold_cached_tokens"] == 0
    cycles = [row for row in rows if row["case"] == "cycle"]
    assert [c["level"] for c in cycles] == [2, 1]
    assert all(c["tokens_equal"] and c["acceptance"] == 1.0 for c in cycles)
    assert all(c["cached_tokens"] == control["cached_tokens"] and c["same_cache"] for c in cycles)
    assert cycles[0]["reload_s"] is not None and cycles[1]["reload_s"] is None
    ranks = [row for row in rows if row["case"] == "rank"]
    assert sorted((r["cycle"], r["rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["sleep_s"] is not None and r["wake_kv_s"] is not None for r in ranks)
    level_1 = [r for r in ranks if r["level"] == 1]
    assert all(r["sleep_bytes_copied"] > 0 and r["sleep_arena_s"] >= 0 for r in level_1)
