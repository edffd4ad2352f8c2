"""Prefix caching and chunked prefill on the GPU, with CUDA graphs and the Triton kernels: hits
equal misses, a level-1 sleep in poison mode and a refit drop the cached KV by themselves, and
chunked steps (decode rows beside chunks, through the Triton prefill kernel) equal whole
prefills."""

from __future__ import annotations

import pytest

from dormant import LLM, SamplingParams
from tests.engine.conftest import hf_state_dict, write_checkpoint
from tests.gpu.conftest import make_engine

pytestmark = pytest.mark.gpu
MiB = 1 << 20
BASE = [(17 * i + 3) % 500 + 1 for i in range(70)]  # 4 full blocks of 16, and 6 more
PROMPTS = [BASE, BASE[:40], [*BASE[:50], 9, 8, 7], [5, 6, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=24, ignore_eos=True)
ROOMIER = dict(max_num_seqs=16, kv_cache_memory_bytes=32 * MiB)  # n=4 samples of 4 prompts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    return (
        write_checkpoint(tmp_path_factory.mktemp("pc_a"), seed=1),
        write_checkpoint(tmp_path_factory.mktemp("pc_b"), seed=2),
    )


def make(engines: list[LLM], checkpoint, **options: object) -> LLM:
    """``make_engine`` with ``ROOMIER`` (``options`` win)."""
    return make_engine(engines, checkpoint, **{**ROOMIER, **options})


def samples(llm: LLM, params: SamplingParams) -> list[list[tuple[int, ...]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-n4"])
def test_hits_equal_misses_with_graphs(engines, checkpoints, params) -> None:
    off = make(engines, checkpoints[0], enable_prefix_caching=False, enable_chunked_prefill=False)
    expected = samples(off, params)
    off.shutdown()
    engines.remove(off)
    on = make(engines, checkpoints[0])
    assert samples(on, params) == expected
    assert samples(on, params) == expected  # now mostly hits
    assert on.memory_status()[0].prefix_cache.num_hit_tokens > 0


def test_sleep_and_refit_drop_the_cached_kv_with_graphs(engines, checkpoints) -> None:
    fresh_b = make(engines, checkpoints[1])
    expected_b = samples(fresh_b, GREEDY)
    fresh_b.shutdown()
    engines.remove(fresh_b)
    llm = make(engines, checkpoints[0], memory_poison=True)  # discarded KV wakes as NaN
    before = samples(llm, GREEDY)
    llm.sleep(level=1)
    assert llm.wake_up()
    assert samples(llm, GREEDY) == before
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.update_weights(hf_state_dict(2))
    llm.wake_up(["kv_cache"])
    outputs = llm.generate([BASE], GREEDY, use_tqdm=False)
    assert outputs[0].num_cached_tokens == 0
    assert samples(llm, GREEDY) == expected_b


def test_chunked_prefill_equals_whole_prefills_with_graphs(engines, checkpoints) -> None:
    whole = make(engines, checkpoints[0], enable_chunked_prefill=False)
    expected = samples(whole, SEEDED)
    whole.shutdown()
    engines.remove(whole)
    chunked = make(engines, checkpoints[0], max_num_batched_tokens=32)
    assert samples(chunked, SEEDED) == expected
