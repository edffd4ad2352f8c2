"""TRL's server mode (``vllm_mode="server"``): TRL 1.16's own ``VLLMClient`` generates, chats and
scores sequences through a dormant server's OpenAI routes, with vLLM's extensions it sends
(``return_token_ids``, ``return_tokens_as_token_ids``, ``prompt_logprobs``, ``top_k: 0``). What
it receives equals what the engine computes for the same requests."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from importlib.util import find_spec

import pytest

from tests.server.conftest import PROMPTS

pytestmark = pytest.mark.skipif(find_spec("trl") is None, reason="TRL is in the test extra")


def _run_client(url: str, prompts: list[list[int]]) -> dict:
    command = [sys.executable, "-m", "tests.server.trl_client_run", url, json.dumps(prompts)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_trl_vllm_client_against_the_server(server) -> None:
    prompts = [PROMPTS[0], PROMPTS[1]]
    got = _run_client(server.url, prompts)
    assert got["model"] == "tiny"

    # generate: greedy tokens as the engine's, with the sampled token's logprob
    body = {"prompt": prompts, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}  # fmt: skip
    direct = server.post("/v1/completions", body).json()["choices"]
    ids = got["ids"]
    assert ids["prompt_ids"] == prompts
    assert ids["completion_ids"] == [c["token_ids"] for c in direct]
    for seq, choice in zip(ids["logprobs"], direct, strict=True):
        assert [p[0] for p in seq] == pytest.approx(choice["logprobs"]["token_logprobs"])
    assert all(len(position) == 1 for seq in ids["logprob_token_ids"] for position in seq)
    # n=2 at TRL's default top_k=0: prompt-major choices, each prompt's two after each other
    sampled = got["sampled"]
    assert sampled["prompt_ids"] == prompts
    assert [len(c) for c in sampled["completion_ids"]] == [3] * 4
    assert [[p[0] for p in seq] for seq in sampled["logprob_token_ids"]] == sampled[
        "completion_ids"
    ]

    # top-2 logprobs: the sampled token (here the top one) and the runner-up, most likely first
    top2 = got["top2"]
    for position_ids, position_lps, token in zip(
        top2["logprob_token_ids"][0], top2["logprobs"][0], top2["completion_ids"][0], strict=True
    ):
        assert position_ids[0] == token and len(position_ids) == 2
        assert position_lps == sorted(position_lps, reverse=True)

    chat = got["chat"]
    assert len(chat["completion_ids"][0]) == 4 and len(chat["prompt_ids"][0]) > 0
    assert [p[0] for p in chat["logprob_token_ids"][0]] == chat["completion_ids"][0]

    # the teacher's scores: the engine's prompt logprobs from position 2, padded to 3
    teacher = got["teacher"]
    scored = server.post(
        "/v1/completions", {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": 3}
    ).json()["choices"]
    for p, prompt in enumerate(prompts):
        positions = scored[p]["prompt_logprobs"]
        for i, position in enumerate(range(2, len(prompt))):
            actual = positions[position][str(prompt[position])]["logprob"]
            assert teacher["actual_logprobs"][p][i] == [pytest.approx(actual)]
            best = sorted(positions[position].values(), key=lambda e: e["rank"])[:3]
            assert teacher["logprobs"][p][i][: len(best)] == pytest.approx(
                [e["logprob"] for e in best]
            )
            assert all(math.isinf(v) for v in teacher["logprobs"][p][i][len(best) :])
