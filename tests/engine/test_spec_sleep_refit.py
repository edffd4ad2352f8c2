"""The draft model through sleep and refit (issue 19, part 2), on the CPU: its weights live in
``weights`` and its KV in ``kv_cache``; a level-2 sleep makes it stale with the target, and
generating refuses until it was refit too; ``reload_weights`` refits both, ``update_weights``
takes the draft's tensors under ``draft.``, and so do SGLang's ``update_weights_from_tensor``
(a flattened bucket of shared handles) and ``update_weights_from_distributed`` (a broadcast
from a trainer in another process, over gloo). The prior art's failure (a draft left stale after a
refit, every draft silently rejected) shows as the acceptance rate: equal before and after."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from dormant import LLM
from dormant.core.errors import WeightsNotLoadedError
from dormant.executors.multiproc import free_port
from dormant.models import WeightError, iterate_safetensors
from dormant.worker.ipc_weights import FLATTENED_BUCKET, flattened_bucket_request
from dormant.worker.update_group import broadcast_weights, create_update_group
from tests.engine.conftest import GREEDY, PROMPTS, tokens, worker_of

OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)


@pytest.fixture
def llm(checkpoint: Path):
    spec = {"model": str(checkpoint), "num_speculative_tokens": 3}
    engine = LLM(str(checkpoint), speculative_config=spec, memory_strict=True, **OPTIONS)
    yield engine
    engine.shutdown()


def _acceptance(llm: LLM) -> float | None:
    stats = llm.llm_engine.spec_decode_stats
    assert stats is not None
    return stats.acceptance_rate


def _fresh_stats(llm: LLM) -> None:
    from dormant.engine.spec_stats import SpecDecodeStats

    llm.llm_engine.spec_decode_stats = SpecDecodeStats()


def test_the_drafts_memory_is_tagged(llm: LLM) -> None:
    worker = worker_of(llm)
    draft = worker.draft
    assert draft is not None
    assert all(worker.mm.tag_of(p) == "weights" for p in draft.model.parameters())
    assert all(worker.mm.tag_of(a.kv_cache) == "kv_cache" for a in draft.model.attention_layers())
    names = set(llm.llm_engine.runtime.weight_names)
    assert {"draft.model.embed_tokens.weight", "model.embed_tokens.weight"} <= names


def test_level_2_cycle_with_reload_weights_keeps_the_acceptance(llm: LLM) -> None:
    before = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _acceptance(llm) == 1.0  # self-speculation
    _fresh_stats(llm)
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    after = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(after) == tokens(before)
    assert _acceptance(llm) == 1.0


def test_a_refit_of_the_target_alone_leaves_the_draft_stale(llm: LLM, checkpoint: Path) -> None:
    before = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.sleep(level=2)
    llm.wake_up()
    target = list(iterate_safetensors(str(checkpoint)))
    llm.update_weights(target)
    with pytest.raises(WeightsNotLoadedError, match="draft\\."):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.update_weights([(f"draft.{name}", tensor) for name, tensor in target])
    _fresh_stats(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(before)
    assert _acceptance(llm) == 1.0


def test_a_draft_refit_with_other_weights_lowers_the_acceptance(
    llm: LLM, other_checkpoint: Path
) -> None:
    """What a stale draft does: output unchanged, drafts rejected; the counts show it."""
    before = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    other = [(f"draft.{n}", t) for n, t in iterate_safetensors(str(other_checkpoint))]
    llm.update_weights(other)
    _fresh_stats(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(before)
    rate = _acceptance(llm)
    assert rate is not None and rate < 0.5


def test_bad_draft_names_are_refused_before_any_write(llm: LLM, checkpoint: Path) -> None:
    target = list(iterate_safetensors(str(checkpoint)))
    worker = worker_of(llm)
    embed = worker.model.model.embed_tokens.weight
    saved = embed.detach().clone()
    bad = [("model.embed_tokens.weight", torch.zeros_like(target[0][1])), ("draft.nope", saved)]
    with pytest.raises(Exception, match="nope"):
        llm.update_weights(bad)
    assert torch.equal(embed, saved)


# ── the cross-process refit paths take the draft's names too ──────────────────────────────

K2 = 2  # speculative tokens of the engines below


def _self_speculating(path: Path) -> LLM:
    spec = {"model": str(path), "num_speculative_tokens": K2}
    return LLM(str(path), speculative_config=spec, memory_strict=True, **OPTIONS)


@pytest.fixture(scope="module")
def expected_other(other_checkpoint: Path) -> list[tuple[int, ...]]:
    """A fresh engine's tokens with self-speculation on the other checkpoint."""
    reference = _self_speculating(other_checkpoint)
    try:
        return tokens(reference.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        reference.shutdown()


def _target_and_draft(path: Path) -> list[tuple[str, torch.Tensor]]:
    """Every weight of ``path`` twice: as the target's and under ``draft.``."""
    weights = list(iterate_safetensors(str(path)))
    return [*weights, *((f"draft.{name}", tensor) for name, tensor in weights)]


def _generates_as_a_fresh_engine(llm: LLM, expected: list[tuple[int, ...]]) -> None:
    """After a refit of target and draft: the KV wakes, and the tokens are a fresh engine's on
    the new weights, every draft accepted (the draft is the new target, not the old one)."""
    llm.wake_up(["kv_cache"])
    _fresh_stats(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert _acceptance(llm) == 1.0


def _refuses_with_the_draft_stale(llm: LLM) -> None:
    """After a refit of the target alone: generation names the draft's stale weights."""
    llm.wake_up(["kv_cache"])
    with pytest.raises(WeightsNotLoadedError, match="draft\\."):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def _asleep_then_weights_awake(path: Path) -> LLM:
    llm = _self_speculating(path)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    return llm


def test_a_flattened_bucket_refits_target_and_draft_after_a_level_2_sleep(
    checkpoint: Path, other_checkpoint: Path, expected_other: list[tuple[int, ...]]
) -> None:
    llm = _asleep_then_weights_awake(checkpoint)
    try:
        entries, flat = flattened_bucket_request(_target_and_draft(other_checkpoint))
        llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET)
        del flat
        _generates_as_a_fresh_engine(llm, expected_other)
    finally:
        llm.shutdown()


def test_a_bucket_of_the_target_alone_leaves_the_draft_stale(
    checkpoint: Path, other_checkpoint: Path
) -> None:
    llm = _asleep_then_weights_awake(checkpoint)
    try:
        target = list(iterate_safetensors(str(other_checkpoint)))
        entries, _flat = flattened_bucket_request(target)
        llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET)
        _refuses_with_the_draft_stale(llm)
        bad = [*((f"draft.{n}", t) for n, t in target), ("draft.nope", target[0][1])]
        entries, _bad_flat = flattened_bucket_request(bad)
        with pytest.raises(WeightError, match="nope"):  # refused: nothing written
            llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET)
        with pytest.raises(WeightsNotLoadedError, match="draft\\."):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


GROUP = "spec-refit"


def _trainer(port: int, path: str, conn: Connection) -> None:
    """Rank 0 of a weight-update group: broadcasts the target's and the draft's weights."""
    group = create_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=60)
    weights = _target_and_draft(Path(path))
    conn.send([(name, str(t.dtype), list(t.shape)) for name, t in weights])
    broadcast_weights(group, weights, timeout_s=60)
    conn.recv()


def test_a_weight_update_group_refits_target_and_draft_after_a_level_2_sleep(
    checkpoint: Path, other_checkpoint: Path, expected_other: list[tuple[int, ...]]
) -> None:
    llm = _asleep_then_weights_awake(checkpoint)
    context = mp.get_context("spawn")
    port, (conn, child) = free_port(), context.Pipe()
    trainer = context.Process(target=_trainer, args=(port, str(other_checkpoint), child))
    trainer.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")
        names, dtypes, shapes = zip(*conn.recv(), strict=True)
        llm.update_weights_from_distributed(names, dtypes, shapes, GROUP)
        conn.send(None)
        llm.destroy_weights_update_group(GROUP)
        _generates_as_a_fresh_engine(llm, expected_other)
    finally:
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()
        llm.shutdown()


# ── the model object's load_weights (TRL colocate, OpenRLHF's worker extension) ──────────


def _model_object(llm: LLM):
    """TRL's path to the model: ``llm.llm_engine.model_executor.driver_worker.model_runner``."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def test_the_model_objects_load_weights_refits_target_and_draft(
    checkpoint: Path, other_checkpoint: Path, expected_other: list[tuple[int, ...]]
) -> None:
    """TRL colocate writes one parameter per call after ``sleep(2)`` + ``wake_up(["weights"])``:
    the draft's names, ``draft.*``, go to the draft as they do through ``update_weights``."""
    llm = _asleep_then_weights_awake(checkpoint)
    try:
        model = _model_object(llm)
        for name, tensor in _target_and_draft(other_checkpoint):
            model.load_weights([(name, tensor)])
        _generates_as_a_fresh_engine(llm, expected_other)
    finally:
        llm.shutdown()


def test_the_model_objects_load_weights_of_the_target_alone_leaves_the_draft_stale(
    checkpoint: Path, other_checkpoint: Path
) -> None:
    llm = _asleep_then_weights_awake(checkpoint)
    try:
        model = _model_object(llm)
        model.load_weights(list(iterate_safetensors(str(other_checkpoint))))
        _refuses_with_the_draft_stale(llm)
    finally:
        llm.shutdown()


def test_the_model_objects_load_weights_refuses_a_bad_draft_name_writing_nothing(
    llm: LLM, other_checkpoint: Path
) -> None:
    worker = worker_of(llm)
    assert worker.draft is not None
    embed, draft_embed = (
        worker.model.model.embed_tokens.weight,
        worker.draft.model.model.embed_tokens.weight,
    )
    saved, draft_saved = embed.detach().clone(), draft_embed.detach().clone()
    other = dict(iterate_safetensors(str(other_checkpoint)))
    bad = [
        ("model.embed_tokens.weight", other["model.embed_tokens.weight"]),
        ("draft.model.embed_tokens.weight", other["model.embed_tokens.weight"]),
        ("draft.nope", saved),
    ]
    with pytest.raises(WeightError, match="nope"):
        _model_object(llm).load_weights(bad)
    assert torch.equal(embed, saved) and torch.equal(draft_embed, draft_saved)
    assert worker.refits.stale == set()  # refused before any write: nothing marked stale


def test_the_model_objects_load_weights_refuses_while_the_weights_sleep(llm: LLM) -> None:
    from dormant.core.errors import EngineAsleepError

    weights = list(worker_of(llm).model.state_dict().items())[:1]
    llm.sleep(level=2)
    with pytest.raises(EngineAsleepError, match="wake_up"):
        _model_object(llm).load_weights([(f"draft.{weights[0][0]}", weights[0][1])])
    llm.wake_up()
