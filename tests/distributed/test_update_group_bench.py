"""``benchmarks/update_group.py`` (issue 20's weight-update group) runs on the CPU: a trainer
process broadcasts to an engine at TP=2 over gloo, by the refit and by a plain broadcast of the
same bytes, and the refit's tokens equal those of the same weights written in-process."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import update_group


def test_the_update_group_benchmark_runs_at_tp2_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(sys, "argv", ["update_group.py", "--tiny", "--repeats", "1"])
    update_group.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    by_case = {row["case"]: row for row in rows}
    assert by_case["setup"]["tp"] == 2 and by_case["setup"]["backend"] == "gloo"
    assert all(by_case[case]["seconds"] > 0 for case in ("refit", "plain", "trainer refit"))
    check = by_case["check"]
    assert check["tokens_equal_in_process_refit"] and check["tokens_changed"]
