"""Fault injection (DESIGN §2.3, "Failures are recoverable"), for every backend call that sleep and
wake make, at every k-th call of it in a realistic cycle of sleeps and wakes.

Each case runs in its own forked process (``fault_runner.py``), so a segfault (touching memory
that is not mapped) fails that case instead of ending the test run. Each case asserts: a typed
error; a truthful ``status()``, compared with the host backend's live handles, mappings and
reservations; every tensor readable after the next wake; the next wake and sleep succeed; bytes
that were preserved are bit-exact; nothing leaked once everything was freed.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dormant.memory import libc
from tests.memory.fault_runner import finish_child, start_child
from tests.memory.faults import COUNTED

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sweep() -> Iterator[tuple[dict[str, list[str]], list[dict[str, Any]]]]:
    """The phase (sleep or wake) of each call of each method in the scenario, and one result per
    case."""
    completed = subprocess.run(
        [sys.executable, "-m", "tests.memory.fault_runner"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    first, *rest = (json.loads(line) for line in completed.stdout.splitlines())
    assert first["dry_run"] == "ok", first["detail"]
    yield first["phases"], rest


@pytest.mark.parametrize("method", COUNTED)
def test_every_call_can_fail(
    sweep: tuple[dict[str, list[str]], list[dict[str, Any]]], method: str
) -> None:
    phases, results = sweep
    calls = phases.get(method, [])
    assert calls, f"the scenario never calls {method}: its cases would prove nothing"
    cases = [r for r in results if r["method"] == method]
    assert len(cases) == sum(2 if phase == "sleep" else 1 for phase in calls), "a case is missing"
    failures = [r for r in cases if r["outcome"] != "ok"]
    report = "\n\n".join(f"{r['case']}: {r['outcome']}\n{r['detail']}" for r in failures[:5])
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n{report}"


def test_a_segfault_in_a_case_is_that_case_failing() -> None:
    """The isolation the sweep relies on: a child that touches unmapped memory is reported as a
    crash by signal, and the runner goes on."""
    unmapped = libc.reserve(4096)  # reserved, not accessible: what a sleeping tensor views
    pid, read_end = start_child(lambda: {"read": [str(ctypes.string_at(unmapped, 1))]})
    result = finish_child(read_end, os.waitpid(pid, 0)[1])
    libc.munmap(unmapped, 4096)
    assert result["outcome"] == "crashed" and "signal 11" in result["detail"]
