"""The offline vLLM API where RL frameworks read it: each case is vLLM's behaviour (the file it
was read from is named), run on the tiny checkpoint's CPU engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant import SamplingParams
from dormant.core.errors import UnsupportedOptionError
from dormant.engine.tokenizer import TokenizerError
from tests.engine.conftest import PROMPTS

TEMPLATE = (
    "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_stop_token_on_the_last_allowed_token_is_a_stop(make_llm, checkpoint: Path) -> None:
    """vllm/v1/core/sched/utils.py ``check_stop``: EOS and ``stop_token_ids`` are checked before
    the length cap, so a stop token sampled as the ``max_tokens``-th token finishes with "stop"
    and its id as ``stop_reason`` (OpenRLHF's ``is_truncated`` reads "length")."""
    llm = make_llm(str(checkpoint))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = list(llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    index = next(i for i, t in enumerate(tokens) if t not in tokens[:i])  # its first occurrence
    last = index + 1
    params = SamplingParams(
        temperature=0.0, max_tokens=last, stop_token_ids=[tokens[index]], ignore_eos=True
    )
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == tokens[:last]
    assert (out.finish_reason, out.stop_reason) == ("stop", tokens[index])


def test_chat_renders_the_template_and_generates(make_llm, checkpoint: Path) -> None:
    """vllm/entrypoints/llm.py ``LLM.chat`` (TRL's vllm_serve ``/chat/``): one conversation or
    a list of them, rendered with ``chat_template`` (and ``chat_template_kwargs``), tokenized
    with ``add_special_tokens=False``, then ``generate``d; the same as generating from ids."""
    llm = make_llm(str(checkpoint))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    chat = [{"role": "user", "content": "the quick brown fox"}]
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(
        chat, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    one = llm.chat(chat, params, use_tqdm=False, chat_template=TEMPLATE)
    two = llm.chat([chat, chat], params, use_tqdm=False, chat_template=TEMPLATE)
    direct = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in one + two] == [ids] * 3
    assert {tuple(o.outputs[0].token_ids) for o in one + two} == {
        tuple(direct[0].outputs[0].token_ids)
    }
    with pytest.raises(TokenizerError, match="chat template"):
        llm.chat(chat, params, use_tqdm=False)  # this tokenizer has none of its own
    assert not llm.llm_engine.has_unfinished_requests()


def test_generate_takes_vllms_lora_request_and_priority(make_llm, checkpoint: Path) -> None:
    """vllm/entrypoints/llm.py ``LLM.generate(..., *, lora_request=None, priority=None)``: the
    defaults (and zeros) run; a LoRA adapter or a priority is refused with a typed error that
    queues nothing."""
    llm = make_llm(str(checkpoint))
    params = SamplingParams(temperature=0.0, max_tokens=2)
    outputs = llm.generate(
        [PROMPTS[0], PROMPTS[1]], params, use_tqdm=False, lora_request=None, priority=[0, 0]
    )
    assert len(outputs) == 2
    for bad in (
        {"lora_request": object()},
        {"lora_request": [None, object()]},
        {"priority": [0, 1]},
    ):
        with pytest.raises(UnsupportedOptionError):
            llm.generate([PROMPTS[0], PROMPTS[1]], params, use_tqdm=False, **bad)
        assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("num_logprobs", [0, 2])
def test_detokenize_false_gives_logprobs_no_text(
    make_llm, checkpoint: Path, num_logprobs: int
) -> None:
    """vllm/v1/engine/output_processor.py ``RequestState.from_new_request``: with
    ``detokenize=False`` the request has no tokenizer, so its text is "" and every
    ``decoded_token`` (sampled and prompt) is None; the logprobs themselves are unchanged."""
    llm = make_llm(str(checkpoint))
    with_text, without = (
        llm.generate(
            "the quick brown fox",
            SamplingParams(
                temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=num_logprobs,
                prompt_logprobs=1, detokenize=detokenize,
            ),
            use_tqdm=False,
        )[0]
        for detokenize in (True, False)
    )  # fmt: skip
    assert without.outputs[0].text == "" and with_text.outputs[0].text != ""
    positions = [*without.outputs[0].logprobs, *without.prompt_logprobs[1:]]
    assert all(lp.decoded_token is None for position in positions for lp in position.values())
    assert any(
        lp.decoded_token for position in with_text.outputs[0].logprobs for lp in position.values()
    )
    assert [{t: lp.logprob for t, lp in p.items()} for p in with_text.outputs[0].logprobs] == [
        {t: lp.logprob for t, lp in p.items()} for p in without.outputs[0].logprobs
    ]


def test_reset_prefix_cache_takes_vllms_arguments(make_llm, checkpoint: Path) -> None:
    """vllm/entrypoints/llm.py ``LLM.reset_prefix_cache(reset_running_requests=False,
    reset_connector=False)``: both are accepted (dormant has no KV connector) and it succeeds."""
    llm = make_llm(str(checkpoint))
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    stats = llm.llm_engine.scheduler.block_manager.prefix_cache_stats()
    assert stats.num_cached_blocks == 0 and stats.num_resets >= 1
