"""The prefix cache is never stale (DESIGN §3 invariant 10): every event that changes a weight or
discards KV memory drops the cached blocks by itself, with no call from the user.

Each trigger has a case of its own: the engine caches a prompt, the trigger happens, and the
same prompt again must give what a fresh engine gives (the new weights' tokens, not the old
KV's). Each case also runs with the cache's reset disabled, and then the tokens must differ:
so the case detects stale KV, and removing the trigger would fail it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.engine.block_manager import BlockManager
from tests.engine.conftest import hf_state_dict
from tests.engine.test_refit_paths import _broadcast_refit

pytestmark = pytest.mark.parametrize("device", ["cpu"])
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = [(11 * i + 5) % 400 + 3 for i in range(29)]  # 7 full blocks of 4, and one token


def generate(llm: LLM) -> tuple[list[int], int]:
    output = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    return list(output.outputs[0].token_ids), output.num_cached_tokens


_EXPECTED: dict[str, list[int]] = {}


def expected(make_llm: Callable[..., LLM], model: Path) -> list[int]:
    """What a fresh engine without prefix caching generates from ``model`` (once per model)."""
    if str(model) not in _EXPECTED:
        fresh = make_llm(str(model), block_size=4, enable_prefix_caching=False)
        _EXPECTED[str(model)] = generate(fresh)[0]
        fresh.shutdown()
    return _EXPECTED[str(model)]


def write_directly(llm: LLM, state_dict: dict[str, torch.Tensor]) -> None:
    """New weights written without the worker's record hearing of it: what a worker extension
    or callable may do by copying into the parameters itself."""
    model = llm.llm_engine.executor.worker.model
    observer, model.weight_observer = model.weight_observer, None
    try:
        model.load_weights(list(state_dict.items()))
    finally:
        model.weight_observer = observer


def refit_callable(worker, seed: int) -> None:  # type: ignore[no-untyped-def]
    worker.model_runner.model.load_weights(list(hf_state_dict(seed).items()))


Trigger = Callable[[LLM, Path], None]


def by_update_weights(llm: LLM, other: Path) -> None:
    llm.update_weights(hf_state_dict(2))


def by_model_object(llm: LLM, other: Path) -> None:
    """TRL's path: the engine hears of it only through the worker's record."""
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for name, tensor in hf_state_dict(2).items():
        model.load_weights([(name, tensor)])


def by_reload_weights(llm: LLM, other: Path) -> None:
    llm.reload_weights(str(other))


def by_tensor_refit(llm: LLM, other: Path) -> None:
    llm.update_weights_from_tensor(list(hf_state_dict(2).items()))


def by_weight_update_group(llm: LLM, other: Path) -> None:
    _broadcast_refit(llm, seed=2)


def by_collective_rpc_callable(llm: LLM, other: Path) -> None:
    llm.collective_rpc(refit_callable, args=(2,))


def by_level_2_cycle(llm: LLM, other: Path) -> None:
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.update_weights(hf_state_dict(2))
    llm.wake_up(["kv_cache"])


REFITS = [
    by_update_weights,
    by_model_object,
    by_reload_weights,
    by_tensor_refit,
    by_weight_update_group,
    by_collective_rpc_callable,
    by_level_2_cycle,
]


@pytest.fixture
def no_reset(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Disables every prefix-cache reset, to show a case would catch a missing trigger."""
    return lambda: monkeypatch.setattr(BlockManager, "reset_prefix_cache", lambda self: None)


@pytest.mark.parametrize("trigger", REFITS, ids=lambda t: t.__name__)
@pytest.mark.parametrize("disable_reset", [False, True], ids=["engine", "without-reset"])
def test_a_refit_by_any_path_drops_the_cached_kv(
    make_llm, checkpoint, other_checkpoint, no_reset, trigger: Trigger, disable_reset: bool
) -> None:
    new_weights = expected(make_llm, other_checkpoint)
    llm = make_llm(str(checkpoint), block_size=4)
    old_weights, _ = generate(llm)
    assert generate(llm) == (old_weights, 28)  # the prompt is cached: 7 blocks hit
    if disable_reset:
        no_reset()
    trigger(llm, other_checkpoint)
    tokens, num_cached = generate(llm)
    if disable_reset:  # stale KV of the old weights: the case can tell
        assert num_cached == 28 and tokens != new_weights
    else:
        assert (tokens, num_cached) == (new_weights, 0)
        assert generate(llm) == (new_weights, 28)  # cached again, under the new weights


def release_kv(llm: LLM) -> None:
    llm.release_memory_occupation(["kv_cache"])
    llm.resume_memory_occupation(["kv_cache"])


def sleep_level_1(llm: LLM) -> None:
    llm.sleep(level=1)
    llm.wake_up()


def sleep_level_1_keep(llm: LLM) -> None:
    llm.sleep(level=1, mode="keep")
    llm.wake_up()


@pytest.mark.parametrize("discard", [release_kv, sleep_level_1, sleep_level_1_keep])
@pytest.mark.parametrize("disable_reset", [False, True], ids=["engine", "without-reset"])
def test_discarded_kv_memory_drops_the_cached_kv(
    make_llm, checkpoint, no_reset, discard: Callable[[LLM], None], disable_reset: bool
) -> None:
    """Poison mode fills the discarded KV with NaN on wake: a hit would read it."""
    llm = make_llm(str(checkpoint), block_size=4, memory_poison=True)
    before, _ = generate(llm)
    if disable_reset:
        no_reset()
    discard(llm)
    tokens, num_cached = generate(llm)
    if disable_reset:
        assert num_cached == 28 and tokens != before
    else:
        assert (tokens, num_cached) == (before, 0)


def test_a_worker_extension_call_drops_the_cached_kv(make_llm, checkpoint, other_checkpoint):
    """An extension may write weights without load_weights (here: param.copy_); every
    extension call or callable drops the cache."""
    new_weights = expected(make_llm, other_checkpoint)
    llm = make_llm(
        str(checkpoint), block_size=4, worker_extension_cls="tests.engine.worker_extensions."
        "RefitExtension",
    )  # fmt: skip
    generate(llm)
    write_directly(llm, hf_state_dict(2))  # invisible to the engine...
    assert generate(llm)[1] == 28  # ...so the stale prefix is still hit: why the rule exists
    llm.collective_rpc("where_am_i")
    assert generate(llm) == (new_weights, 0)
    generate(llm)
    write_directly(llm, hf_state_dict(1))
    llm.collective_rpc(lambda worker: None)
    assert generate(llm)[1] == 0


def test_a_failed_step_drops_the_blocks_it_published(make_llm, checkpoint, no_reset):
    """The first step publishes the prompt's blocks, then fails before computing them: they
    must not be hit by the retry (they hold never-written KV)."""
    expected_tokens = expected(make_llm, checkpoint)

    def run(disable_reset: bool) -> tuple[list[int], int]:
        llm = make_llm(str(checkpoint), block_size=4)
        executor = llm.llm_engine.executor
        launch = executor.launch  # every call the engine makes (UniprocExecutor)
        calls = []

        def failing(step, multi_step=False):  # type: ignore[no-untyped-def]
            calls.append(step)
            if len(calls) == 1:
                raise RuntimeError("injected step failure")
            return launch(step, multi_step)

        executor.launch = failing  # type: ignore[method-assign]
        if disable_reset:
            no_reset()
        with pytest.raises(RuntimeError, match="injected"):
            generate(llm)
        return generate(llm)

    assert run(disable_reset=False) == (expected_tokens, 0)
    tokens, num_cached = run(disable_reset=True)
    assert num_cached == 28 and tokens != expected_tokens


def test_reset_prefix_cache_still_works(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint), block_size=4)
    before, _ = generate(llm)
    assert llm.reset_prefix_cache() is True
    assert generate(llm) == (before, 0)
    stats = llm.memory_status()[0].prefix_cache
    # 29 + 12 tokens, of which the last was sampled but never computed: 10 full blocks
    assert stats.num_resets == 1 and stats.num_cached_blocks == 10
