"""TRL's ``VLLMClient`` (``vllm_mode="server"``, trl/generation/vllm_client.py, TRL 1.16) against
a dormant server, in a process of its own: TRL checks for vLLM at import, so this process calls
``dormant.install_as_vllm()`` first, as a TRL script does. Prints one JSON line of results."""

from __future__ import annotations

import json
import sys

import dormant

dormant.install_as_vllm()

from trl.generation.vllm_client import VLLMClient  # noqa: E402


def main(url: str, prompts: list[list[int]]) -> None:
    client = VLLMClient(base_url=url)
    greedy = dict(temperature=0.0, max_tokens=4, generation_kwargs={"ignore_eos": True})
    results = {
        "model": client.model,
        "ids": client.generate(prompts, logprobs=0, **greedy),
        "sampled": client.generate(prompts, n=2, max_tokens=3, top_k=0),
        "top2": client.generate(["the quick brown fox"], logprobs=2, **greedy),
        "chat": client.chat(
            [[{"role": "user", "content": "the quick brown fox"}]], logprobs=1, **greedy
        ),
        "teacher": client.get_sequence_logprobs(prompts, [2] * len(prompts), top_logprobs=3),
    }
    client.reset_prefix_cache()
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
