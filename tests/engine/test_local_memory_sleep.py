"""A sleep gives the context's local memory back after everything else, and the first wake
restores it, before the engine generates again (``worker/rank_sleep.py``)."""

from __future__ import annotations

from unittest import mock

from dormant.memory.local_memory import LocalMemory
from tests.engine.conftest import GREEDY, PROMPTS, tokens


def test_sleep_releases_the_local_memory_and_the_first_wake_restores_it(
    make_llm, checkpoint
) -> None:
    llm = make_llm(str(checkpoint))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    calls: list[str] = []
    with (
        mock.patch.object(LocalMemory, "release", lambda self: calls.append("release")),
        mock.patch.object(LocalMemory, "restore", lambda self: calls.append("restore")),
    ):
        llm.sleep(level=2)
        assert calls == ["release"]
        llm.wake_up(["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(["kv_cache"])
    assert calls == ["release", "restore", "restore"]  # restoring twice is a no-op (its test)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before
