"""``benchmarks/refit.py`` runs on the CPU (``--tiny``): the chosen sender modes only, the engine
side polling for its buckets (``--spin``), every IPC refit verified against what was sent; an
unknown mode is refused before anything runs."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import refit


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> list:
    monkeypatch.setattr(sys, "argv", ["refit.py", "--tiny", "--repeats", "1", *args])
    refit.main()
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]


def test_the_chosen_modes_run_spinning_and_arrive(monkeypatch, capsys) -> None:
    rows = run(monkeypatch, capsys, "--modes", "reuse,new", "--spin")
    setup = rows[0]
    assert setup["modes"] == ["reuse", "new"] and setup["spin"]
    ipc = [row for row in rows if row["case"].startswith("ipc buckets")]
    assert [row["case"].split(", ")[1][:5] for row in ipc] == ["one r", "a new"]
    assert all(row["verified"] and row["engine_s"] > 0 for row in ipc)


def test_an_unknown_mode_is_refused(monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit):
        run(monkeypatch, capsys, "--modes", "new,bogus")
    assert "bogus" in capsys.readouterr().err
