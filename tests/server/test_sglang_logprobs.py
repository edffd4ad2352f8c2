"""``/generate``'s ``logprob_start_len`` as SGLang resolves it (``Scheduler.
handle_generate_request``; the entries from ``SchedulerLogprobResultProcessor``, the keys from
``TokenizerManager.add_logprob_to_meta_info``), each case against the prompt logprobs the
engine computes for the whole prompt (vLLM's ``prompt_logprobs``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from dormant.core.sampling_params import SamplingParams
from tests.server.conftest import PROMPTS

PROMPT = PROMPTS[2]  # 10 tokens
TOP = 3


def engine_prompt_logprobs(server, prompt: list[int]) -> list[Any]:
    """The engine's own prompt logprobs (with the top ``TOP``), outside the server."""

    async def run() -> Any:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP)
        async for output in server.engine.generate({"prompt_token_ids": prompt}, params, "ref"):
            last = output
        return last.prompt_logprobs

    return asyncio.run(run())


def generate(server, start: int | None, top: int = 0, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": top,
        **fields,
    }
    reply = server.post("/generate", body)
    assert reply.status_code == 200, reply.text
    return reply.json()["meta_info"]


def top_of(position: dict[int, Any], k: int) -> list[list[Any]]:
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank <= k)
    return [[logprob, t, None] for _, t, logprob in ranked]


@pytest.mark.parametrize("start", [0, 1, 4, len(PROMPT) - 1])
@pytest.mark.parametrize("top", [0, TOP])
def test_input_logprobs_cover_the_prompt_from_logprob_start_len(server, start, top) -> None:
    reference = engine_prompt_logprobs(server, PROMPT)
    meta = generate(server, start, top)
    entries = meta["input_token_logprobs"]
    assert meta["prompt_tokens"] == start + len(entries)  # SGLang's own test of it
    assert [e[1] for e in entries] == PROMPT[start:]
    # As SGLang: the first entry has no logprob (it computes a position's logprob from the
    # position before's logits, only from logprob_start_len on), at 0 or at any other start.
    assert entries[0][0] is None
    expected = [reference[p][t].logprob for p, t in enumerate(PROMPT) if p > start]
    assert [e[0] for e in entries[1:]] == pytest.approx(expected, abs=1e-5)
    assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"]) == 2
    if top:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(entries) and tops[0] is None
        for position, got in zip(reference[start + 1 :], tops[1:], strict=True):
            want = top_of(position, top)
            assert [e[1] for e in got] == [e[1] for e in want]
            assert [e[0] for e in got] == pytest.approx([e[0] for e in want], abs=1e-5)
        assert [len(t) for t in meta["output_top_logprobs"]] == [top, top]
    else:
        assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta


@pytest.mark.parametrize("top", [0, TOP])
def test_by_default_and_at_the_prompts_end_no_prompt_position_is_returned(server, top) -> None:
    # SGLang resolves -1 (the default, and null) to the prompt's length: the output's logprobs
    # only, with the input keys present and empty; the prompt's are not computed, so the
    # prefix cache serves a repeated prompt as it does without logprobs.
    long_prompt = list(range(40, 80))  # two full blocks of 16
    generate(server, None, input_ids=long_prompt, return_logprob=False)
    for start in (-1, None, len(long_prompt)):
        meta = generate(server, start, top, input_ids=long_prompt)
        assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 2
        assert meta["cached_tokens"] == 32
        if top:
            assert meta["input_top_logprobs"] == []
    # The last position alone: its entry has no logprob, so none is computed either.
    meta = generate(server, len(long_prompt) - 1, top, input_ids=long_prompt)
    assert meta["input_token_logprobs"] == [[None, long_prompt[-1], None]]
    assert meta["cached_tokens"] == 32


def test_a_start_past_the_prompt_is_refused_and_runs_nothing(server) -> None:
    for start, word in ((len(PROMPT) + 1, "higher than the number of input tokens"), (-2, "-1")):
        body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start}
        reply = server.post("/generate", body)
        assert reply.status_code == 400 and word in reply.json()["error"]["message"]
    # In a batch, the prompt it is past refuses the whole call before any prompt runs.
    body = {"input_ids": [PROMPT, PROMPTS[1]], "return_logprob": True, "logprob_start_len": 4}
    reply = server.post("/generate", body)
    assert reply.status_code == 400 and "(3)" in reply.json()["error"]["message"]
    assert "dormant_prompt_tokens_total{" not in server.get("/metrics").text  # none ran
    # Without return_logprob SGLang ignores logprob_start_len.
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "logprob_start_len": 99}
    assert server.post("/generate", body).status_code == 200


def test_texts_come_with_every_logprob_entry_top_ones_included(server) -> None:
    meta = generate(server, 0, TOP, return_text_in_logprobs=True)
    tops = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    entries += [entry for top in tops for entry in top]
    assert all(isinstance(entry[2], str) for entry in entries)


def test_every_stream_chunk_carries_the_input_logprobs(server) -> None:
    whole = generate(server, 2, TOP)
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": TOP,
        "stream": True,
    }
    lines = server.post("/generate", body).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert meta["input_token_logprobs"] == whole["input_token_logprobs"]
        assert meta["input_top_logprobs"] == whole["input_top_logprobs"]
        assert meta["output_token_logprobs_length"] == len(chunk["output_ids"])


def test_each_prompt_and_sample_of_a_batch_gets_its_own_prompts_entries(server) -> None:
    batch = [PROMPT, PROMPTS[0]]
    sampling = {"max_new_tokens": 2, "n": 2}
    body = {"input_ids": batch, "sampling_params": sampling, "return_logprob": True}
    replies = server.post("/generate", {**body, "logprob_start_len": 1}).json()
    assert len(replies) == 4  # prompt-major, then sample
    for reply, prompt in zip(replies, [PROMPT, PROMPT, PROMPTS[0], PROMPTS[0]], strict=True):
        entries = reply["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt[1:] and entries[0][0] is None
        expected = engine_prompt_logprobs(server, prompt)
        want = [expected[p][t].logprob for p, t in enumerate(prompt) if p > 1]
        assert [e[0] for e in entries[1:]] == pytest.approx(want, abs=1e-5)
