"""Speculative sampling keeps the target's distribution, end to end through the engine (issue
19): over many seeds, the first two sampled tokens of a request with self-speculation (argmax
drafts, which random rows accept with probability p(draft)) follow the target's processed
distribution, read from the same outputs' processed logprobs. An always-accepting verifier, the
bug the test is for, fails the same check."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.worker import spec_step

NUM_SAMPLES = 1500
TOP = 4  # each position samples from 4 tokens: 16 (x0, x1) cells
OPTIONS = dict(
    device="cpu", max_model_len=64, max_num_seqs=64, kv_cache_memory_bytes=16 << 20,
    logprobs_mode="processed_logprobs",
)  # fmt: skip


def critical_value(df: int, z: float = 4.75) -> float:
    """The chi-square value exceeded with probability ~1e-6 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def joint_chi_square(llm: LLM) -> tuple[float, int]:
    """Chi-square of the sampled (x0, x1) against p(x0) p(x1 | x0), and its degrees of freedom;
    the probabilities are the outputs' own processed logprobs (the target's)."""
    params = [
        SamplingParams(
            temperature=1.5, top_k=TOP, seed=seed, max_tokens=3, logprobs=TOP, ignore_eos=True
        )
        for seed in range(NUM_SAMPLES)
    ]
    outputs = llm.generate([[5, 17, 99, 3]] * NUM_SAMPLES, params, use_tqdm=False)
    counts: Counter[tuple[int, int]] = Counter()
    first: dict[int, float] = {}
    second: dict[tuple[int, int], float] = {}
    for output in outputs:
        completion = output.outputs[0]
        x0, x1 = completion.token_ids[:2]  # x1: verified against one draft
        counts[x0, x1] += 1
        first.update({t: math.exp(lp.logprob) for t, lp in completion.logprobs[0].items()})
        second.update({(x0, t): math.exp(lp.logprob) for t, lp in completion.logprobs[1].items()})
    expected = {(a, b): first[a] * p for (a, b), p in second.items() if a in first}
    value = sum((counts[c] - NUM_SAMPLES * p) ** 2 / (NUM_SAMPLES * p) for c, p in expected.items())
    assert set(counts) <= set(expected)
    return value, len(expected) - 1


@pytest.fixture(scope="module")
def llm(checkpoint: Path):
    spec = {"model": str(checkpoint), "num_speculative_tokens": 2}
    engine = LLM(str(checkpoint), speculative_config=spec, **OPTIONS)
    yield engine
    engine.shutdown()


def test_the_first_two_tokens_follow_the_target(llm: LLM) -> None:
    value, df = joint_chi_square(llm)
    stats = llm.llm_engine.spec_decode_stats
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert value < critical_value(df)


def test_an_always_accepting_verifier_fails_the_check(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    def accept_all(target_logits, drafts, probs, sampling):  # type: ignore[no-untyped-def]
        bonus = target_logits[:, -1].argmax(-1, keepdim=True)
        emitted = torch.cat([drafts, bonus], dim=-1)
        return emitted, torch.full_like(bonus[:, 0], drafts.shape[1] + 1)

    monkeypatch.setattr(spec_step, "verify", accept_all)
    value, df = joint_chi_square(llm)
    assert value > 10 * critical_value(df)
