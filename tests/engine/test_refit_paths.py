"""Refits from the trainer's side, through ``LLM`` (issue #13): TRL's model-object loop with fp32
tensors into a bf16 engine, SGLang's ``update_weights_from_tensor`` (named tensors and a
flattened bucket of shared handles), and a weight-update group over gloo with a trainer in
another process, including one that dies mid-broadcast. Tokens always equal a fresh engine's."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import Connection

import pytest

from dormant import LLM
from dormant.engine import WeightsNotLoadedError
from dormant.executors.multiproc import free_port
from dormant.worker.ipc_weights import FLATTENED_BUCKET, flattened_bucket_request
from dormant.worker.transfer_errors import WeightTransferError
from dormant.worker.update_group import broadcast_weights, create_update_group
from tests.engine.conftest import GREEDY, PROMPTS, hf_state_dict, tokens

pytestmark = pytest.mark.parametrize("device", ["cpu"])
GROUP = "refit"


@pytest.fixture
def expected_b(make_llm, other_checkpoint) -> list[tuple[int, ...]]:
    """What a fresh engine generates on the new weights (checkpoint b = hf_state_dict(2))."""
    reference = make_llm(str(other_checkpoint))
    result = tokens(reference.generate(PROMPTS, GREEDY))
    reference.shutdown()
    return result


def test_trl_loop_writes_fp32_through_the_model_object(make_llm, checkpoint, other_checkpoint):
    """TRL 1.16 `vllm_generation.py`: after `sleep(level=2)` and `wake_up(tags=["weights"])`, each
    fp32 parameter goes to `llm.llm_engine.model_executor.driver_worker.model_runner.model
    .load_weights([(name, param)])`, then `wake_up(tags=["kv_cache"])`."""
    reference = make_llm(str(other_checkpoint), dtype="bfloat16")
    expected = tokens(reference.generate(PROMPTS, GREEDY))
    reference.shutdown()
    llm = make_llm(str(checkpoint), dtype="bfloat16")
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for name, param in hf_state_dict(2).items():  # fp32, cast into bf16 on copy
        model.load_weights([(name, param)])
    llm.wake_up(tags=["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected


def test_update_weights_from_tensor_named_and_flattened(make_llm, checkpoint, expected_b):
    llm = make_llm(str(checkpoint))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    assert llm.generate(PROMPTS, GREEDY)[0].weight_version == "default"
    llm.update_weights_from_tensor(list(hf_state_dict(2).items()), weight_version="step-1")
    outputs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outputs) == expected_b
    assert llm.get_weight_version() == "step-1"
    assert {o.weight_version for o in outputs} == {"step-1"}  # each output names its weights
    entries, flat = flattened_bucket_request(list(hf_state_dict(1).items()))
    llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET, weight_version="step-2")
    del flat  # the sender may drop its buffer once the call returned
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before
    assert llm.get_weight_version() == "step-2"


def _trainer(port: int, seed: int, die_after: int | None, conn: Connection) -> None:
    """Rank 0 of the weight-update group: broadcasts hf_state_dict(seed), or dies partway."""
    group = create_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=60)
    weights = list(hf_state_dict(seed).items())
    conn.send([(name, str(t.dtype), list(t.shape)) for name, t in weights])
    if die_after is not None:
        broadcast_weights(group, weights[:die_after], timeout_s=60)
        os._exit(1)
    broadcast_weights(group, weights, timeout_s=60)
    conn.recv()


def _start_trainer(seed: int, die_after: int | None = None):
    context = mp.get_context("spawn")
    port = free_port()
    parent, child = context.Pipe()
    process = context.Process(target=_trainer, args=(port, seed, die_after, child), daemon=True)
    process.start()
    return port, parent, process


def _broadcast_refit(llm: LLM, seed: int, die_after: int | None = None) -> None:
    port, conn, process = _start_trainer(seed, die_after)
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")
        names, dtypes, shapes = zip(*conn.recv(), strict=True)
        llm.update_weights_from_distributed(names, dtypes, shapes, GROUP, weight_version="v")
        conn.send(None)
        llm.destroy_weights_update_group(GROUP)
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def test_a_weight_update_group_refits_from_another_process(make_llm, checkpoint, expected_b):
    llm = make_llm(str(checkpoint))
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    _broadcast_refit(llm, seed=2)
    llm.wake_up(["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected_b


def test_a_sender_killed_mid_broadcast_leaves_the_weights_stale(make_llm, checkpoint, expected_b):
    llm = make_llm(str(checkpoint))
    with pytest.raises(WeightTransferError):
        _broadcast_refit(llm, seed=2, die_after=5)
    with pytest.raises(WeightsNotLoadedError):
        llm.generate(PROMPTS, GREEDY)
    assert llm.get_weight_version() == "default"
    _broadcast_refit(llm, seed=2)  # a complete refit makes it generate again
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected_b
