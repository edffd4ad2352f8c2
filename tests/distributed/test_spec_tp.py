"""Speculative decoding under tensor parallelism on the CPU (gloo, TP=2): every rank drafts and
verifies alike, so the output equals TP=1 without speculation; the draft is refit on every rank
after a level-2 sleep."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant import LLM
from tests.engine.conftest import GREEDY, PROMPTS, write_checkpoint

OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("spec_tp"), seed=1)


def tokens(llm: LLM) -> list[tuple[int, ...]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_tp2_self_speculation_equals_tp1_and_survives_level_2(checkpoint: Path) -> None:
    with LLM(str(checkpoint), **OPTIONS) as llm:
        reference = tokens(llm)
    spec = {"model": str(checkpoint), "num_speculative_tokens": 3}
    with LLM(str(checkpoint), tensor_parallel_size=2, speculative_config=spec, **OPTIONS) as llm:
        assert tokens(llm) == reference
        stats = llm.llm_engine.spec_decode_stats
        assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens > 0
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        assert len(llm.collective_rpc("reload_weights")) == 2
        llm.wake_up(["kv_cache"])
        assert tokens(llm) == reference
        assert stats.num_accepted_tokens == stats.num_draft_tokens
