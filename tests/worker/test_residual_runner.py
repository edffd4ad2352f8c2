"""The residual benchmark's parent (``benchmarks/residual.py``, what the GPU residual tests
run) stops a child that goes silent: it used to check its deadline only when a line came, so
a child hung in its zero-residual cycle held the whole GPU suite."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import residual

PHASE = json.dumps({"event": "phase", "phase": "stuck here"})
SILENT = f"import time; print({PHASE!r}, flush=True); time.sleep(60)"


def test_a_silent_child_is_stopped_at_the_deadline_naming_its_phase(monkeypatch) -> None:
    monkeypatch.setattr(residual, "child_command", lambda case: [sys.executable, "-c", SILENT])
    with pytest.raises(TimeoutError, match="stuck here"):
        residual.run_case("release", timeout_s=2.0)


def test_a_child_that_ends_without_a_result_is_reported(monkeypatch) -> None:
    monkeypatch.setattr(residual, "child_command", lambda case: [sys.executable, "-c", "pass"])
    with pytest.raises(RuntimeError, match="no result"):
        residual.run_case("eager", timeout_s=30.0)
