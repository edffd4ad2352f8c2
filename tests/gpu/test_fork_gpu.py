"""The fork of a request's ``n`` samples on the GPU: a tiny bf16 model with CUDA graphs, ``n=8``,
argmax sampling (top-k 1: vLLM refuses ``n > 1`` at temperature 0). Forked samples equal the
no-fork path's (each sample prefilled, hitting the prompt's full blocks in the prefix cache),
every prompt is computed once, and the 8 samples of a prompt are equal to each other (the
siblings' copies of the leader's partial last block hold its KV)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from dormant import LLM, SamplingParams
from dormant.engine.batch import ScheduledBatch
from dormant.engine.block_manager import BlockManager
from dormant.engine.scheduler import Scheduler
from tests.engine.conftest import write_checkpoint

pytestmark = pytest.mark.gpu
MiB = 1 << 20
# 70 and 45 tokens (not block multiples: the copy path), and 64 (a multiple of 16)
PROMPTS = [[(17 * i + 3 + p) % 500 + 1 for i in range(n)] for p, n in enumerate((70, 45, 64))]
ARGMAX = SamplingParams(n=8, temperature=1.0, top_k=1, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return write_checkpoint(tmp_path_factory.mktemp("fork_ckpt"), seed=1)


@pytest.fixture
def llm(checkpoint) -> Iterator[LLM]:
    engine = LLM(
        str(checkpoint), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=32,
        kv_cache_memory_bytes=32 * MiB,
    )  # fmt: skip
    yield engine
    engine.shutdown()


def rebuild_scheduler(llm: LLM, enable_fork: bool) -> list[ScheduledBatch]:
    """A fresh scheduler and block manager (cold cache) with forks on or off, as
    benchmarks/rollout.py builds its variants; returns the list its batches are recorded in."""
    engine = llm.llm_engine
    old = engine.scheduler
    manager = old.block_manager
    blocks = BlockManager(manager.num_blocks, manager.block_size, enable_prefix_caching=True)
    engine.scheduler = Scheduler(
        replace(old.config, enable_fork=enable_fork), blocks, old.eos_token_ids
    )
    batches: list[ScheduledBatch] = []
    schedule = engine.scheduler.schedule

    def recorded() -> ScheduledBatch | None:
        batch = schedule()
        if batch is not None:
            batches.append(batch)
        return batch

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    return batches


def samples(llm: LLM) -> list[list[tuple[int, ...]]]:
    outputs = llm.generate(PROMPTS, ARGMAX, use_tqdm=False)
    return [[tuple(c.token_ids) for c in o.outputs] for o in outputs]


def test_forked_samples_equal_the_no_fork_path_with_graphs(llm: LLM) -> None:
    assert llm.llm_engine.executor.worker.runner.graphs is not None  # decode steps replay
    unforked = rebuild_scheduler(llm, enable_fork=False)
    expected = samples(llm)
    assert not any(b.fork_of for b in unforked)
    forked = rebuild_scheduler(llm, enable_fork=True)
    got = samples(llm)
    assert got == expected
    assert all(len(set(row)) == 1 for row in got)  # identical logits, identical KV
    assert sum(b.num_prefill_tokens for b in forked) == sum(map(len, PROMPTS))
    assert sum(b.num_prefill_tokens for b in unforked) > sum(map(len, PROMPTS))
    assert sum(len(b.block_copies) for b in forked) == 2 * 7  # 70 and 45 tokens: partial
    decode_steps = [b for b in forked if not b.is_prefill]
    assert decode_steps and all(b.num_seqs == 24 for b in decode_steps[:8])
