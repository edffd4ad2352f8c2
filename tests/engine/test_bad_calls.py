"""Bad calls get typed errors and change nothing (DESIGN §3, STYLE "errors for people")."""

from __future__ import annotations

import pytest
import torch

from dormant import LLM
from dormant.engine import (
    EngineAsleepError,
    SleepLevelConflictError,
    SleepModeDisabledError,
    UnknownRpcMethodError,
)
from dormant.memory import SleepConflictError, UnknownTagError
from dormant.models import WeightError
from tests.engine.conftest import GREEDY, PROMPTS, hf_state_dict, tokens


def asleep_tags(llm: LLM) -> dict[str, str]:
    return {t.tag: t.state for t in llm.memory_status()[0].tags}


def test_sleep_twice_at_one_level_is_a_noop_another_level_raises(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(level=1)
    state = asleep_tags(llm)
    llm.sleep(level=1)
    assert asleep_tags(llm) == state
    with pytest.raises(SleepLevelConflictError, match="level 1") as caught:
        llm.sleep(level=2)
    assert isinstance(caught.value, SleepConflictError)  # catchable as the memory layer's error
    assert asleep_tags(llm) == state and llm.llm_engine.sleep_level == 1
    llm.wake_up()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


def test_waking_an_unknown_tag_raises_and_changes_nothing(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    llm.sleep(level=1)
    state = asleep_tags(llm)
    with pytest.raises(UnknownTagError, match="kv_cahce"):
        llm.wake_up(["weights", "kv_cahce"])
    assert asleep_tags(llm) == state
    llm.wake_up()


def test_generating_while_asleep_raises_and_queues_nothing(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    llm.sleep(level=1)
    with pytest.raises(EngineAsleepError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.wake_up(["weights"])  # still not enough: the KV cache is asleep
    with pytest.raises(EngineAsleepError, match="kv_cache"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up(["kv_cache"])
    assert len(llm.generate(PROMPTS, GREEDY)) == len(PROMPTS)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda sd: sd.update(
                {"model.layers.0.mlp.up_prj.weight": sd.pop("model.layers.0.mlp.up_proj.weight")}
            ),
            "up_prj",
        ),
        (lambda sd: sd.update({"model.norm.weight": torch.ones(65)}), "model.norm.weight"),
        (lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"].to(torch.int32)}), "dtype"),
    ],
    ids=["wrong-name", "wrong-shape", "wrong-dtype"],
)
def test_refit_with_bad_weights_raises_and_writes_nothing(make_llm, checkpoint, mutate, message):
    llm = make_llm(str(checkpoint))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    new = hf_state_dict(2)
    mutate(new)
    with pytest.raises(WeightError, match=message):
        llm.update_weights(new)  # every other entry is valid and different: none may be written
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


def test_refit_while_weights_are_asleep_raises(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    llm.sleep(level=2)
    with pytest.raises(EngineAsleepError, match="weights"):
        llm.update_weights(hf_state_dict(2))
    with pytest.raises(EngineAsleepError):
        llm.reload_weights()
    llm.wake_up(["weights"])
    llm.update_weights(hf_state_dict(2))


def test_collective_rpc_only_calls_allowlisted_methods(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    for method in ("__init__", "shutdown", "mm", "load_model", "execute"):
        with pytest.raises(UnknownRpcMethodError, match="no method"):
            llm.collective_rpc(method)
    assert llm.collective_rpc("check_health") == [True]


def test_sleep_arguments_are_validated(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="mode"):
        llm.sleep(level=1, mode="later")
    assert not llm.is_sleeping()


def test_sleep_needs_sleep_mode(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint), enable_sleep_mode=False)
    with pytest.raises(SleepModeDisabledError):
        llm.sleep(level=1)
    assert not llm.is_sleeping()


def test_unknown_options_raise(device, checkpoint) -> None:
    with pytest.raises(TypeError, match="gpu_memory_utilisation"):
        LLM(str(checkpoint), device=device, gpu_memory_utilisation=0.5)
