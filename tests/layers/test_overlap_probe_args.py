"""``benchmarks/overlap_probe.py`` refuses a ``--carveouts`` that is not a list of SM counts
before it touches a device (the probe itself needs CUDA: its figures are in RESULTS.md)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import overlap_probe


@pytest.mark.parametrize("carveouts", ["16,x", "0", "132", "-8"])
def test_a_bad_carveout_is_refused(monkeypatch, capsys, carveouts: str) -> None:
    monkeypatch.setattr(sys, "argv", ["overlap_probe.py", "--carveouts", carveouts])
    with pytest.raises(SystemExit) as exit_info:
        overlap_probe.main()
    assert exit_info.value.code == 2 and "--carveouts" in capsys.readouterr().err
