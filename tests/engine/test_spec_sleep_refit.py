"""The draft model through sleep and refit (issue 19, part 2), on the CPU: its weights live in
``weights`` and its KV in ``kv_cache``; a level-2 sleep makes it stale with the target, and
generating refuses until it was refit too; ``reload_weights`` refits both, ``update_weights``
takes the draft's tensors under ``draft.``. The prior art's failure (a draft left stale after a
refit, every draft silently rejected) shows as the acceptance rate: equal before and after."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dormant import LLM
from dormant.core.errors import WeightsNotLoadedError
from dormant.models import iterate_safetensors
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
