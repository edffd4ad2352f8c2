"""A failed driver call in the middle of an engine's sleep, on the GPU with CUDA graphs: the
engine tells the truth, refuses to generate, and the next wake restores every byte, so the
graphs replay and the tokens are identical (issue #11)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dormant import LLM, SamplingParams
from dormant.memory import DriverError, TagState
from tests.engine.conftest import PROMPTS, write_checkpoint

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MiB = 1 << 20


@pytest.fixture
def llm(tmp_path) -> Iterator[LLM]:
    engine = LLM(
        str(write_checkpoint(tmp_path / "ckpt", seed=1)),
        device="cuda",
        max_model_len=256,
        max_num_seqs=8,
        kv_cache_memory_bytes=16 * MiB,
    )
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_cu_mem_release_failing_during_sleep(llm: LLM, failing_call: int) -> None:
    worker = llm.llm_engine.executor.worker
    backend = worker.mm.backend
    assert worker.runner.graphs is not None  # the graphs are what the wake must keep valid
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    real_release, calls = backend.release, []

    def failing_release(handle: int) -> None:
        calls.append(handle)
        if len(calls) == failing_call:
            raise DriverError("cuMemRelease failed (injected): CUDA_ERROR_UNKNOWN")
        real_release(handle)

    backend.release = failing_release
    try:
        with pytest.raises(DriverError, match="cuMemRelease"):
            llm.sleep(level=1)
    finally:
        backend.release = real_release
    states = dict(worker.mm.tag_states())
    assert any(state is not TagState.AWAKE for state in states.values()), states
    assert llm.is_sleeping()
    assert llm.wake_up() is True
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert after == before
    llm.sleep(level=1)
    assert llm.wake_up() is True
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == before
