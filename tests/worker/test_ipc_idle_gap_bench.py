"""``benchmarks/ipc_idle_gap.py`` runs on the CPU (``--tiny``): every (sender, gap, prod) is
timed, and a gap that is not a positive number of microseconds, or an unknown prod, is refused
before anything runs."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import ipc_idle_gap


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> list:
    monkeypatch.setattr(sys, "argv", ["ipc_idle_gap.py", "--tiny", "--rounds", "1", *args])
    ipc_idle_gap.main()
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]


def test_every_sender_gap_and_prod_is_timed(monkeypatch, capsys) -> None:
    rows = run(monkeypatch, capsys, "--gaps-us", "50", "--prods", "none,event")
    timed = {
        (r["sender"], r["gap"], r["gap_us"], r["prod"]) for r in rows if r["case"] == "ipc idle gap"
    }
    assert timed == {
        (sender, gap, us, prod)
        for prod in ("none", "event")
        for sender in ("new", "held")
        for gap, us in (
            ("none", 0),
            ("sleep", 50),
            ("spin", 50),
            ("ping", 0),
            ("touch", 0),
            ("pack", 0),
        )
    }
    assert all(r["calls"] == rows[0]["buckets_per_refit"] for r in rows[1:])


@pytest.mark.parametrize("gaps", ["0", "a,b"])
def test_a_bad_gap_is_refused(monkeypatch, capsys, gaps: str) -> None:
    with pytest.raises(SystemExit):
        run(monkeypatch, capsys, "--gaps-us", gaps)
    assert "--gaps-us" in capsys.readouterr().err


def test_an_unknown_prod_is_refused(monkeypatch, capsys) -> None:
    with pytest.raises(SystemExit):
        run(monkeypatch, capsys, "--prods", "none,kick")
    assert "kick" in capsys.readouterr().err
