"""vLLM's worker extensions and open in-process ``collective_rpc`` (issue #13): an extension's
methods run on every worker and refit through ``self.model_runner.model``; a callable runs as
``fn(worker)``; unknown names and conflicts get typed errors."""

from __future__ import annotations

import pytest

from dormant.engine import UnknownRpcMethodError
from dormant.worker.extension import WorkerExtensionError
from tests.engine.conftest import GREEDY, PROMPTS, hf_state_dict, tokens

EXTENSION = "tests.engine.worker_extensions.RefitExtension"
pytestmark = pytest.mark.parametrize("device", ["cpu"])


def test_an_extension_refits_after_a_level_2_sleep(make_llm, checkpoint, other_checkpoint) -> None:
    reference = make_llm(str(other_checkpoint))
    expected = tokens(reference.generate(PROMPTS, GREEDY))
    reference.shutdown()
    llm = make_llm(str(checkpoint), worker_extension_cls=EXTENSION)
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    assert llm.collective_rpc("refit_from_state_dict", args=(hf_state_dict(2),)) == [0]
    llm.wake_up(["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    assert llm.collective_rpc("where_am_i") == [(0, "cpu")]


def test_an_unknown_method_lists_what_exists(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint), worker_extension_cls=EXTENSION)
    with pytest.raises(UnknownRpcMethodError, match="refit_from_state_dict"):
        llm.collective_rpc("refit_from_state_dikt")
    with pytest.raises(UnknownRpcMethodError, match="no worker_extension_cls"):
        make_llm(str(checkpoint)).collective_rpc("where_am_i")


def test_an_extension_may_not_shadow_the_worker(make_llm, checkpoint) -> None:
    with pytest.raises(WorkerExtensionError, match="sleep"):
        make_llm(
            str(checkpoint),
            worker_extension_cls="tests.engine.worker_extensions.ConflictingExtension",
        )
    with pytest.raises(WorkerExtensionError, match="cannot import"):
        make_llm(str(checkpoint), worker_extension_cls="tests.engine.no_such_module.Extension")


def test_a_callable_runs_on_every_worker(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    offset = 40
    assert llm.collective_rpc(lambda worker: worker.rank + offset) == [40]  # a closure, too
    names = llm.collective_rpc(lambda worker, n: sorted(worker.model.state_dict())[:n], args=(2,))
    assert len(names) == 1 and len(names[0]) == 2


def test_vllm_attribute_path_reaches_the_model(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    executor = llm.llm_engine.model_executor
    model = executor.driver_worker.model_runner.model  # TRL's path
    assert model is executor.driver_worker.worker.model_runner.model  # vLLM's full path
    assert model is executor.worker.model
