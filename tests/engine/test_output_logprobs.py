"""Sampled-token logprobs in the outputs: each position in vLLM's shape, its text the id's own
(``decode_each``, memoized per id by the output processor), the cumulative logprob their sum."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dormant import SamplingParams
from dormant.engine.tokenizer import ByteTokenizer
from tests.engine.conftest import PROMPTS


@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_positions_carry_each_ids_own_text(make_llm, checkpoint: Path, num_logprobs: int) -> None:
    llm = make_llm(str(checkpoint))
    tokenizer = llm.llm_engine.tokenizer
    params = SamplingParams(
        temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True, logprobs=num_logprobs
    )
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    seen: dict[int, int] = {}
    for completion in (c for o in outputs for c in o.outputs):
        assert len(completion.logprobs) == len(completion.token_ids) == 12
        total = 0.0
        for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
            assert next(iter(position)) == token_id  # the sampled token first
            assert len(position) in (num_logprobs or 1, num_logprobs + 1)
            for entry_id, logprob in position.items():
                assert logprob.decoded_token == tokenizer.decode_each([entry_id])[0]
                seen[entry_id] = seen.get(entry_id, 0) + 1
            total += position[token_id].logprob
        assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-6, abs_tol=1e-6)
    assert max(seen.values()) > 1  # ids repeat: the memo was read, not only filled


def test_byte_tokenizer_texts_are_its_decode_of_each_id() -> None:
    tokenizer = ByteTokenizer()
    ids = [-1, 0, 65, 127, 128, 200, 255, 256, 257, 300]
    assert tokenizer.decode_each(ids) == [tokenizer.decode([t]) for t in ids]


def test_no_tokenizer_gives_no_text(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint), skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    output = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    positions = output.outputs[0].logprobs
    assert len(positions) == 4
    assert all(lp.decoded_token is None for p in positions for lp in p.values())
