"""The RL lifecycle: tokens identical before and after every sleep/wake cycle (DESIGN §3)."""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch

from dormant import SamplingParams
from dormant.engine import EngineAsleepError, WeightsNotLoadedError
from tests.engine.conftest import GREEDY, PROMPTS, SEEDED, hf_state_dict, tokens, worker_of

POISON = [False, True]


@pytest.mark.parametrize("poison", POISON)
def test_level_1_cycle(make_llm, checkpoint, poison: bool) -> None:
    llm = make_llm(str(checkpoint), memory_poison=poison)
    greedy, seeded = tokens(llm.generate(PROMPTS, GREEDY)), tokens(llm.generate(PROMPTS, SEEDED))
    assert len(set(greedy[0])) > 3  # a real model: varied tokens, not one repeated
    llm.sleep(level=1)
    status = llm.memory_status()[0]
    assert status.tag("weights").state == "offloaded" and status.tag("weights").mapped_bytes == 0
    assert status.tag("kv_cache").state == "discarded" and status.tag("kv_cache").mapped_bytes == 0
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == greedy
    assert tokens(llm.generate(PROMPTS, SEEDED)) == seeded


@pytest.mark.parametrize("poison", POISON)
def test_level_2_reload_weights(make_llm, checkpoint, poison: bool) -> None:
    """vLLM's documented RL sequence, verbatim."""
    llm = make_llm(str(checkpoint), memory_poison=poison)
    before = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


@pytest.mark.parametrize("poison", POISON)
def test_generating_after_level_2_without_refit_raises(make_llm, checkpoint, poison) -> None:
    llm = make_llm(str(checkpoint), memory_poison=poison)
    before = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(WeightsNotLoadedError, match="reload_weights"):
        llm.generate(PROMPTS, GREEDY)
    state = {k: v for k, v in hf_state_dict(1).items() if "layers.0." in k}
    llm.update_weights(state)  # a partial refit is not enough
    with pytest.raises(WeightsNotLoadedError):
        llm.generate(PROMPTS, GREEDY)
    llm.update_weights(hf_state_dict(1))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


@pytest.mark.parametrize("poison", POISON)
def test_level_2_update_weights_matches_a_fresh_engine(
    make_llm, checkpoint, other_checkpoint, poison: bool
) -> None:
    llm = make_llm(str(checkpoint), memory_poison=poison)
    before = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.update_weights(hf_state_dict(2))  # the trainer's new weights, as a state dict
    llm.wake_up(["kv_cache"])
    refit = tokens(llm.generate(PROMPTS, GREEDY))
    refit_seeded = tokens(llm.generate(PROMPTS, SEEDED))
    llm.shutdown()  # one engine per device at a time
    fresh = make_llm(str(other_checkpoint))
    assert refit == tokens(fresh.generate(PROMPTS, GREEDY))
    assert refit_seeded == tokens(fresh.generate(PROMPTS, SEEDED))
    assert refit != before


def test_dummy_weights_reload_reruns_the_seeded_init(make_llm) -> None:
    from dormant.models import ModelConfig
    from tests.engine.conftest import hf_config

    config = ModelConfig.from_dict(hf_config().to_dict())
    llm = make_llm(config, seed=7)
    before = tokens(llm.generate(PROMPTS, SEEDED))
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.reload_weights()
    llm.wake_up(["kv_cache"])
    assert tokens(llm.generate(PROMPTS, SEEDED)) == before


@pytest.mark.parametrize("poison", POISON)
def test_fp8_kv_cache_through_level_2(make_llm, checkpoint, poison: bool) -> None:
    """The prior art's test_deep_sleep_fp8_kvcache: calibrated scales survive level 2."""
    llm = make_llm(str(checkpoint), kv_cache_dtype="fp8", memory_poison=poison)
    layers = worker_of(llm).model.attention_layers()
    for layer in layers:
        layer.k_scale.fill_(0.5)
        layer.v_scale.fill_(0.25)
        assert layer.kv_cache.dtype == torch.float8_e4m3fn
    before = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")  # the checkpoint has no scales: they must survive
    llm.wake_up(["kv_cache"])
    for layer in layers:
        assert float(layer.k_scale) == 0.5 and float(layer.v_scale) == 0.25
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


def test_kv_wake_does_not_run_recovery(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    worker = worker_of(llm)
    before = tokens(llm.generate(PROMPTS, GREEDY))
    inputs = worker.runner.inputs.tensors()
    caches = [layer.kv_cache for layer in worker.model.attention_layers()]
    scales = [layer.k_scale for layer in worker.model.attention_layers()]
    snapshot = [(t, t.data_ptr()) for t in (*inputs, *caches, *scales)]
    forbidden = [
        "dormant.worker.worker.allocate_kv_cache",
        "dormant.worker.worker.ModelRunner",
        "dormant.worker.model_runner.InputBuffers",
        "dormant.worker.worker.Worker.init_kv_cache",
        "dormant.worker.worker.Worker.load_model",
    ]
    patches = [
        mock.patch(target, side_effect=AssertionError(f"{target} ran")) for target in forbidden
    ]
    for patch in patches:
        patch.start()
    try:
        for level in (1, 2):
            llm.sleep(level=level)
            llm.wake_up(["weights"])
            if level == 2:
                llm.reload_weights()
            llm.wake_up(["kv_cache"])
    finally:
        for patch in patches:
            patch.stop()
    now = [
        *worker.runner.inputs.tensors(),
        *(a.kv_cache for a in worker.model.attention_layers()),
        *(a.k_scale for a in worker.model.attention_layers()),
    ]
    assert all(a is b for a, (b, _) in zip(now, snapshot, strict=True))  # same objects
    assert [t.data_ptr() for t in now] == [p for _, p in snapshot]  # same addresses
    llm.collective_rpc("verify_guards")
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


def test_level_0_pauses_scheduling_only(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    mapped = llm.memory_status()[0].tag("weights").mapped_bytes
    llm.sleep(level=0)
    assert llm.is_sleeping()
    assert llm.memory_status()[0].tag("weights").mapped_bytes == mapped
    with pytest.raises(EngineAsleepError, match="paused"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


def test_sglang_release_and_resume(make_llm, checkpoint) -> None:
    llm = make_llm(str(checkpoint))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    llm.release_memory_occupation(["kv_cache"])
    status = llm.memory_status()[0]
    assert status.tag("kv_cache").state == "discarded" and status.tag("weights").state == "awake"
    with pytest.raises(EngineAsleepError):
        llm.generate(PROMPTS, GREEDY)
    llm.resume_memory_occupation(["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before
    llm.release_memory_occupation()
    llm.resume_memory_occupation()
    assert (
        tokens(
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        )
        == before
    )


def test_shutdown_returns_the_memory(make_llm, checkpoint) -> None:
    """Regression: shutdown closed the manager but kept the model and KV cache alive, so a
    second engine on the same device found no room (dormant demo on the H200)."""
    llm = make_llm(str(checkpoint))
    backend = worker_of(llm).mm.backend
    free_before, _ = backend.memory_info()
    llm.shutdown()
    free_after, _ = backend.memory_info()
    assert free_after - free_before >= 4 << 20  # at least the KV cache came back


@pytest.mark.parametrize("speculative", [False, True])
def test_shutdown_frees_the_weights_while_the_llm_object_lives(
    make_llm, checkpoint, speculative: bool
) -> None:
    """Regression: the memory manager's pointer guards kept their sources after shutdown, and
    those closures hold the model (and a draft's), so the weights lived on with the ``LLM``
    object. A loop that makes its next engine before dropping the last (``llm = LLM(...)``)
    found a model's worth less memory per engine (benchmarks/spec_decode.py on the H200:
    no room for a KV block by the fourth engine)."""
    spec = {"model": str(checkpoint), "num_speculative_tokens": 2} if speculative else None
    llm = make_llm(str(checkpoint), speculative_config=spec)
    worker = worker_of(llm)
    tensors = [next(worker.model.parameters()), worker.model.attention_layers()[0].kv_cache]
    if speculative:
        tensors.append(next(worker.draft.model.parameters()))
    refs = [weakref.ref(t) for t in tensors]
    del worker, tensors
    llm.shutdown()
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)


def test_kv_cache_tag_holds_only_the_backing(make_llm, checkpoint) -> None:
    """DESIGN §3 invariant 1, through the audit: one declared block in kv_cache, nothing else."""
    llm = make_llm(str(checkpoint), memory_strict=True)
    records = llm.audit()[0].by_tag("kv_cache")
    caches = [layer.kv_cache for layer in worker_of(llm).model.attention_layers()]
    assert len(records) == 1 and records[0].is_declared
    assert records[0].address == caches[0].data_ptr()
    assert records[0].nbytes == sum(c.numel() * c.element_size() for c in caches)
    llm.sleep(level=2)  # strict mode: would raise on any undeclared allocation in kv_cache
    llm.wake_up()
