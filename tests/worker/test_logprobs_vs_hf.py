"""Logprobs from the worker equal the trainer's numbers: Hugging Face ``transformers``'
log-softmax over the same weights, teacher-forced on the same tokens (fp32, within 1e-4), for
greedy and seeded sampling, in the raw and processed modes; prompt logprobs too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM
from worker_setup import BLOCK_SIZE, MAX_MODEL_LEN

from dormant.core.sampling_params import SamplingParams
from dormant.core.step_input import SeqInput, StepInput
from dormant.core.step_output import SeqOutput, TokenLogprobs
from dormant.worker.worker import Worker

PROMPTS = [(5, 17, 99, 3, 250, 42, 8), (7, 301, 7)]
NUM_DECODE_STEPS = 5
NUM_TOP = 3
NUM_PROMPT_TOP = 2
BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
GREEDY = SamplingParams(temperature=0.0, logprobs=NUM_TOP, prompt_logprobs=NUM_PROMPT_TOP)
SEEDED = SamplingParams(
    temperature=0.8, top_k=20, top_p=0.9, seed=3, logprobs=NUM_TOP, prompt_logprobs=NUM_PROMPT_TOP
)


@pytest.fixture
def mode(worker: Worker, request: pytest.FixtureRequest) -> Iterator[str]:
    previous = worker.runner.logprobs_mode
    worker.runner.logprobs_mode = request.param
    yield request.param
    worker.runner.logprobs_mode = previous


def generate(worker: Worker, params: SamplingParams) -> list[list[SeqOutput]]:
    """A prefill of ``PROMPTS`` then ``NUM_DECODE_STEPS`` decodes, inputs built by hand."""
    seqs = tuple(
        SeqInput(
            token_ids=prompt,
            start_position=0,
            block_table=tuple(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)),
            params=params,
            seed=100 + i,
            num_output_tokens=0,
            compute_prompt_logprobs=True,
        )
        for i, prompt in enumerate(PROMPTS)
    )
    outputs = [list(worker.execute(StepInput(seqs, is_prefill=True)).seqs)]
    for _ in range(NUM_DECODE_STEPS):
        seqs = tuple(s.advanced(o.token_ids[0]) for s, o in zip(seqs, outputs[-1], strict=True))
        outputs.append(list(worker.execute(StepInput(seqs, is_prefill=False)).seqs))
    return [list(per_seq) for per_seq in zip(*outputs, strict=True)]


def hf_logits(model: Qwen3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float()


def processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """vLLM's processed logits, computed here independently: temperature, top-k, top-p."""
    if params.is_greedy:
        return logits
    scaled = logits / params.temperature
    sorted_values, order = scaled.sort(dim=-1, descending=True)
    assert params.top_k is not None
    keep = (torch.arange(scaled.shape[-1]) < params.top_k).expand_as(scaled)
    # top-p over the renormalised top-k: keep while the mass before a token is below top_p
    kept_probs = sorted_values.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    keep = keep & ((kept_probs.cumsum(dim=-1) - kept_probs) < params.top_p)
    masked = sorted_values.masked_fill(~keep, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, masked)


def check_entry(entry: TokenLogprobs, reference: torch.Tensor, token: int, num_top: int) -> None:
    """``entry`` against reference logprobs [V] of one position, for ``token``."""
    assert entry.token_ids[0] == token
    assert entry.logprobs[0] == pytest.approx(float(reference[token]), abs=1e-4)
    assert entry.ranks[0] == 1 + int((reference > reference[token]).sum())
    top_values, top_ids = reference.topk(num_top)
    # Ids of -inf entries (filtered tokens, processed mode) are in no particular order.
    finite = torch.isfinite(top_values).tolist()
    assert [i for i, f in zip(entry.token_ids[1:], finite, strict=True) if f] == [
        i for i, f in zip(top_ids.tolist(), finite, strict=True) if f
    ]
    torch.testing.assert_close(torch.tensor(entry.logprobs[1:]), top_values, atol=1e-4, rtol=0)
    assert entry.ranks[1:] == tuple(range(1, num_top + 1))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"], indirect=True)
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_logprobs_equal_hf_teacher_forced(
    worker: Worker,
    hf_model_and_path: tuple[Qwen3ForCausalLM, Path],
    mode: str,
    params: SamplingParams,
) -> None:
    hf_model = hf_model_and_path[0]
    for prompt, steps in zip(PROMPTS, generate(worker, params), strict=True):
        generated = [o.token_ids[0] for o in steps]
        logits = hf_logits(hf_model, [*prompt, *generated])
        # Prompt logprobs: every prompt position but the first, always raw.
        prompt_entries = steps[0].prompt_logprobs
        assert prompt_entries is not None and len(prompt_entries) == len(prompt) - 1
        raw = logits.log_softmax(dim=-1)
        for position, entry in enumerate(prompt_entries):
            check_entry(entry, raw[position], prompt[position + 1], NUM_PROMPT_TOP)
        assert all(o.prompt_logprobs is None for o in steps[1:])
        # Sampled tokens: position len(prompt) - 1 + i predicts generated[i].
        values = logits if mode == "raw_logprobs" else processed(logits, params)
        expected = values.log_softmax(dim=-1)[len(prompt) - 1 :]
        for i, output in enumerate(steps):
            assert output.logprobs is not None and len(output.logprobs) == 1
            check_entry(output.logprobs[0], expected[i], generated[i], NUM_TOP)
        if params.is_greedy:
            assert generated == logits[len(prompt) - 1 :].argmax(dim=-1).tolist()[: len(generated)]
