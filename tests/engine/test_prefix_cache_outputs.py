"""Prefix-cache hits give what misses give: tokens (greedy and seeded), logprobs and ``n``
samples equal an engine without prefix caching, also when blocks are evicted under pressure;
``num_cached_tokens`` and ``memory_status()`` say what was hit."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant import SamplingParams

pytestmark = pytest.mark.parametrize("device", ["cpu"])
BASE = [(13 * i + 7) % 500 + 1 for i in range(24)]  # 6 full blocks of 4
PROMPTS = [BASE, [*BASE[:17], 3, 4, 5], [*BASE, 9, 9], BASE[:9], [1, 2, 3, 4, 5]]
SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)


def run(llm, params: SamplingParams) -> tuple[list, list]:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    samples = [[tuple(c.token_ids) for c in o.outputs] for o in outputs]
    logprobs = [
        [
            lp[token].logprob
            for c in o.outputs
            for lp, token in zip(c.logprobs, c.token_ids, strict=True)
        ]
        for o in outputs
    ]
    return [samples, logprobs], [o.num_cached_tokens for o in outputs]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_hits_equal_misses(make_llm, checkpoint: Path, params: SamplingParams) -> None:
    off = make_llm(str(checkpoint), block_size=4, enable_prefix_caching=False)
    (expected, expected_logprobs), no_hits = run(off, params)
    assert no_hits == [0] * len(PROMPTS)
    on = make_llm(str(checkpoint), block_size=4)
    (first, first_logprobs), cached = run(on, params)
    # Within one call: BASE is computed first; the others hit its blocks as they share them.
    assert cached == [0, 16, 24, 8, 0]
    (again, again_logprobs), cached_again = run(on, params)
    assert cached_again == [20, 16, 24, 8, 4]  # up to the block before each last token
    assert first == expected and again == expected
    for got in (first_logprobs, again_logprobs):
        for row, want in zip(got, expected_logprobs, strict=True):
            assert row == pytest.approx(want, abs=1e-4)


def test_n_samples_share_the_first_samples_blocks(make_llm, checkpoint: Path) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    off = make_llm(str(checkpoint), block_size=4, enable_prefix_caching=False)
    on = make_llm(str(checkpoint), block_size=4, max_num_seqs=16)
    expected = [[c.token_ids for c in o.outputs] for o in off.generate(PROMPTS[:3], params)]
    outputs = on.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    # Samples 1-3 fork from sample 0 (engine/forks.py): their whole prompt counts as cached
    assert [o.num_cached_tokens for o in outputs] == [24, 20, 26]
    stats = on.memory_status()[0].prefix_cache
    # 3 prompts x 4 samples looked up: BASE's first sample misses, the other prompts' first
    # samples hit BASE's blocks, and every fork hits its whole prompt
    assert stats.num_query_tokens == 4 * (24 + 20 + 26)
    assert stats.num_hit_tokens == 16 + 24 + 3 * (24 + 20 + 26)


def test_eviction_under_pressure_keeps_outputs_equal(make_llm, checkpoint: Path) -> None:
    """A cache of 24 blocks for prompts that together need many more: cached blocks are
    evicted (least recently freed first) and recomputed when needed again."""
    prompts = [[(p * 31 + i * 7) % 500 + 1 for i in range(30)] for p in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    off = make_llm(str(checkpoint), block_size=4, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    on = make_llm(str(checkpoint), block_size=4, num_gpu_blocks_override=24, max_num_seqs=2)
    for order in (prompts, prompts[::-1], prompts):
        outputs = on.generate(order, params, use_tqdm=False)
        want = expected if order is prompts else expected[::-1]
        assert [o.outputs[0].token_ids for o in outputs] == want
    stats = on.memory_status()[0].prefix_cache
    assert stats.num_evictions > 0 and 0 < stats.num_hit_tokens < stats.num_query_tokens
    assert stats.num_cached_blocks <= 24


def test_memory_status_reports_the_prefix_cache(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint), block_size=4)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    status = llm.memory_status()[0]
    assert status.tag("kv_cache").mapped_bytes > 0  # still the memory layer's report
    stats = status.prefix_cache
    assert stats.is_enabled and stats.hit_rate == pytest.approx(20 / 48)
    assert stats.num_cached_blocks == 8  # 24 + 10 tokens, the last one never computed
    assert "prefix cache: 8 blocks cached" in status.table()
    llm.sleep(level=1)
    assert llm.memory_status()[0].prefix_cache.num_cached_blocks == 0  # dropped at once
    llm.wake_up()
    off = make_llm(str(checkpoint), enable_prefix_caching=False)
    assert "prefix cache: off" in off.memory_status()[0].table()
