"""The host-overhead benchmark's decode-graph path (``benchmarks/host_overhead.py
--multi-steps``) runs what it says it times: every timed call replays the stand-in graph of its
kind (``worker_case`` raises when a call fell back to single steps), with the replays' time
taken out of the figures."""

from __future__ import annotations

import gc

import pytest

from benchmarks.host_overhead import engine_case, worker_case
from dormant.worker.worker import Worker


@pytest.mark.parametrize("multi_steps", [None, 1, 4])
def test_worker_case_times_each_call(multi_steps: int | None) -> None:
    timed = worker_case(4, 16, 3, stub=True, profile=False, multi_steps=multi_steps)
    assert len(timed.times) == 3 and all(t > 0 for t in timed.times)
    assert len(timed.gc_collections) == 3 and min(timed.gc_collections) >= 0


def test_worker_case_freezes_the_set_up_only_while_timing() -> None:
    worker_case(4, 16, 2, stub=True, profile=False, multi_steps=4, gc_freeze=True)
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("multi_steps", [None, 1, 4])
def test_engine_case_times_each_step_on_its_path(multi_steps: int | None) -> None:
    """Each timed ``LLMEngine.step()`` replays the graph of its kind (``engine_case`` raises
    when a step ran eagerly), and the worker's ``init_kv_cache`` is restored after the set-up."""
    init_kv_cache = Worker.init_kv_cache
    timed = engine_case(4, 16, 3, True, False, False, multi_steps)
    assert len(timed.times) == 3 and all(t > 0 for t in timed.times)
    assert Worker.init_kv_cache is init_kv_cache
