"""The shapes of vLLM calls that verl and NeMo-RL make on their rollout paths, where dormant
once lacked them or behaved differently (found writing tests/frameworks/test_verl_calls.py and
test_nemo_rl_calls.py). Each test fails without its fix."""

from __future__ import annotations

import pytest

from dormant.core.errors import EngineAsleepError
from tests.engine.conftest import hf_state_dict, worker_of


@pytest.mark.parametrize("level", [1, 2])
def test_a_write_through_the_model_object_while_asleep_is_refused(
    make_llm, checkpoint, level: int
) -> None:
    """A worker extension's ``self.model_runner.model.load_weights(...)`` (verl, NeMo-RL, TRL)
    before ``wake_up(["weights"])``: a typed error and nothing changes (it was a segfault on
    the host backend, an illegal address on the GPU)."""
    llm = make_llm(str(checkpoint), enable_sleep_mode=True)
    llm.sleep(level=level)
    before = worker_of(llm).sleep_state()
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    with pytest.raises(EngineAsleepError, match="wake_up"):
        model.load_weights(list(hf_state_dict(2).items()))
    assert worker_of(llm).sleep_state() == before  # nothing marked stale or written
    llm.wake_up(["weights"])
    model.load_weights(list(hf_state_dict(2).items()))  # awake: the same call writes
    assert worker_of(llm).sleep_state().stale_weights == frozenset()
