"""The rollout API's behaviour: refusals that change nothing, stop strings and min_tokens
against hand-computed references, ``n`` samples sharing their prompt's KV, and vLLM's small
calls (tokenizer, model config, prefix-cache reset, options)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant import LLM, SamplingParams
from dormant.core.errors import (
    InvalidSamplingParamsError,
    UnsupportedOptionError,
    UnsupportedSamplingParamsError,
)
from dormant.models import ModelConfig
from tests.engine.conftest import PROMPTS, hf_config

GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)


def queued(llm: LLM) -> int:
    scheduler = llm.llm_engine.scheduler
    return scheduler.num_waiting + scheduler.num_running


def bad(**changes: object) -> SamplingParams:
    """Valid params made bad by assignment, as a caller may (fields are assignable)."""
    params = SamplingParams(temperature=0.8, max_tokens=4)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    ("params", "error"),
    [
        (bad(n=0), InvalidSamplingParamsError),
        (bad(logprobs=21), InvalidSamplingParamsError),  # max_logprobs is 20
        (bad(min_tokens=5), InvalidSamplingParamsError),
        (bad(presence_penalty=-2.5), InvalidSamplingParamsError),
        (bad(repetition_penalty=-1.0), InvalidSamplingParamsError),
        (bad(frequency_penalty=3.0), InvalidSamplingParamsError),
        (bad(structured_outputs={"regex": "a"}), UnsupportedSamplingParamsError),
        (bad(stop_token_ids=[512]), InvalidSamplingParamsError),  # outside the vocabulary
    ],
)
def test_bad_params_raise_typed_errors_and_queue_nothing(
    make_llm, checkpoint: Path, params: SamplingParams, error: type[Exception]
) -> None:
    llm = make_llm(str(checkpoint))
    good = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(error):  # the bad one is last: the good ones before it are not queued
        llm.generate(PROMPTS, [good, good, params], use_tqdm=False)
    assert queued(llm) == 0 and not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError):
        llm.llm_engine.add_request(PROMPTS[0], params)
    assert queued(llm) == 0
    assert llm.generate(PROMPTS[0], good, use_tqdm=False)[0].finished  # still serves


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"quantization": "fp8"}, "quantization='fp8'"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
        ({"enable_expert_parallel": True}, "enable_expert_parallel"),
        ({"model_impl": "transformers"}, "model_impl"),
        ({"logprobs_mode": "raw"}, "logprobs_mode='raw'"),
        ({"load_format": "pt"}, "load_format='pt'"),
        ({"compilation_config": {"level": 3}}, r"\['level'\]"),
        ({"compilation_config": {"cudagraph_mode": "SOMETIMES"}}, "cudagraph_mode"),
    ],
)
def test_options_dormant_cannot_honour_raise(option: dict[str, object], match: str) -> None:
    model = ModelConfig.from_dict(hf_config().to_dict())
    with pytest.raises(UnsupportedOptionError, match=match):
        LLM(model, device="cpu", **option)  # type: ignore[arg-type]


def test_unknown_option_raises_type_error() -> None:
    model = ModelConfig.from_dict(hf_config().to_dict())
    with pytest.raises(TypeError):
        LLM(model, device="cpu", enable_prefix_cache=True)  # misspelled


def test_compilation_config_maps_to_graph_options() -> None:
    from dormant.core.config import EngineConfig

    model = ModelConfig.from_dict(hf_config().to_dict())
    config = EngineConfig.create(
        model, compilation_config='{"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [4, 1]}'
    )
    assert config.enforce_eager and config.cuda_graph_batch_sizes == (1, 4)


def reference(llm: LLM, prompt: list[int]) -> tuple[list[int], list[str]]:
    """The greedy tokens and the text after each of them, decoded from scratch: a streamed
    text holds back the bytes of a character not yet complete, where a whole decode shows
    U+FFFD, so those are dropped."""
    tokens = llm.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    texts = [
        tokenizer.decode(tokens.token_ids[: k + 1]).rstrip("\ufffd")
        for k in range(len(tokens.token_ids))
    ]
    return list(tokens.token_ids), texts


def test_stop_strings_cut_tokens_and_text(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint))
    tokens, texts = reference(llm, PROMPTS[1])
    # A stop string from the middle of the text: two characters of a token after the third.
    k = next(i for i in range(3, len(texts)) if len(texts[i]) - len(texts[i - 1]) >= 2)
    stop = texts[k][len(texts[k - 1]) : len(texts[k - 1]) + 2]
    first = next(i for i, text in enumerate(texts) if stop in text)
    start = texts[first].index(stop)
    cut = llm.generate([PROMPTS[1]], SamplingParams(**GREEDY, stop=[stop]), use_tqdm=False)
    out = cut[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert (out.text, out.finish_reason, out.stop_reason) == (texts[first][:start], "stop", stop)
    kept = SamplingParams(**GREEDY, stop=stop, include_stop_str_in_output=True)
    out = llm.generate([PROMPTS[1]], kept, use_tqdm=False)[0].outputs[0]
    assert out.text == texts[first][: start + len(stop)] and out.token_ids == tokens[: first + 1]
    # min_tokens past the stop: no stop string is looked for before, so it runs to the end.
    late = SamplingParams(**GREEDY, stop=[stop], min_tokens=first + 1)
    out = llm.generate([PROMPTS[1]], late, use_tqdm=False)[0].outputs[0]
    assert texts[first].count(stop) == texts[-1].count(stop)  # no later occurrence
    assert (out.token_ids, out.text, out.finish_reason) == (tokens, texts[-1], "length")


def test_stop_token_ids_and_min_tokens(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint))
    tokens, texts = reference(llm, PROMPTS[0])
    stop_id = tokens[1]
    first = tokens.index(stop_id)
    params = SamplingParams(**GREEDY, stop_token_ids=[stop_id])
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]  # the stop token is kept in token_ids...
    assert out.text == (texts[first - 1] if first else "")  # ...and not in the text
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # min_tokens masks the stop token until it is reached, so it cannot end the output early.
    params = SamplingParams(**GREEDY, stop_token_ids=[stop_id], min_tokens=6)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:6] and len(out.token_ids) >= 6


def count_prefilled_tokens(llm: LLM) -> list[int]:
    """Wraps the executor: records how many positions each prefill step computes."""
    executor, counts = llm.llm_engine.executor, []
    launch = executor.launch  # every call the engine makes (UniprocExecutor)

    def recording(step, multi_step=False):  # type: ignore[no-untyped-def]
        if step.is_prefill:
            counts.append(step.num_tokens)
        return launch(step, multi_step)

    executor.launch = recording  # type: ignore[method-assign]
    return counts


def test_n_samples_share_the_prompt_kv(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint), block_size=4)
    prompt = list(range(10, 30))  # 20 tokens: blocks 0-3 full; the last token's block is 4
    counts = count_prefilled_tokens(llm)
    params = SamplingParams(n=4, temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    # Sample 0 computes the prompt; the others fork from it and compute none of it.
    assert sum(counts) == 20
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    # Each sample equals a request of its own seeded with seed + index (vLLM's child seeds).
    for index, completion in enumerate(output.outputs):
        alone = SamplingParams(temperature=0.9, seed=7 + index, max_tokens=6, ignore_eos=True)
        again = llm.generate([prompt], alone, use_tqdm=False)[0].outputs[0]
        assert completion.token_ids == again.token_ids
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    scheduler = llm.llm_engine.scheduler
    scheduler.block_manager.check_invariant([])
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_grpo_shape_16_prompts_8_samples(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint), max_num_seqs=128, kv_cache_memory_bytes=16 << 20)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(5 + i)] for i in range(16)]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=8, logprobs=0, seed=3)
    first = llm.generate(prompts, params, use_tqdm=False)
    assert len(first) == 16 and all(len(o.outputs) == 8 for o in first)
    assert [o.prompt_token_ids for o in first] == prompts
    for output in first:
        for completion in output.outputs:
            assert 1 <= len(completion.token_ids) <= 8
            assert len(completion.logprobs) == len(completion.token_ids)
    second = llm.generate(prompts, params, use_tqdm=False)  # seeded: reproducible per sample
    assert [[c.token_ids for c in o.outputs] for o in second] == [
        [c.token_ids for c in o.outputs] for o in first
    ]


def test_n_with_a_first_sample_that_finishes_in_prefill(make_llm, checkpoint: Path) -> None:
    """max_tokens=1: the first sample is done (its blocks freed) before the others start;
    they compute the whole prompt themselves."""
    llm = make_llm(str(checkpoint), block_size=4)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=1, ignore_eos=True)
    output = llm.generate([list(range(1, 14))], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in output.outputs] == [1, 1, 1] and output.finished


def test_prompt_logprobs_start_with_none(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, logprobs=3)
    output = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(PROMPTS[0])
    for token_id, position in zip(PROMPTS[0][1:], output.prompt_logprobs[1:], strict=True):
        assert token_id in position and len(position) in (2, 3)
        assert all(lp.decoded_token is not None for lp in position.values())


def test_small_vllm_calls(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint))
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    config = llm.llm_engine.model_config
    assert config.max_model_len == 256 and config.hf_config.vocab_size == 512
    assert str(config.dtype) == "torch.float32"
    assert llm.reset_prefix_cache() is True
    text = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert text.prompt == "hello world" and len(text.outputs[0].token_ids) <= 3


def test_skip_tokenizer_init_needs_token_ids(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("hello", SamplingParams(), use_tqdm=False)
    with pytest.raises(InvalidSamplingParamsError, match="tokenizer"):
        llm.generate([PROMPTS[0]], SamplingParams(stop=["x"]), use_tqdm=False)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3), False)
    assert out[0].outputs[0].text == "" and queued(llm) == 0


def test_bad_words_are_tokenized_and_never_generated(make_llm, checkpoint: Path) -> None:
    llm = make_llm(str(checkpoint))
    tokens, texts = reference(llm, PROMPTS[1])
    word = next(w for w in ("hello", "world", "stop", "here") if w in texts[-1])
    word_ids = llm.get_tokenizer().encode(word, add_special_tokens=False)
    assert len(word_ids) == 1 and word_ids[0] in tokens  # the greedy run says it
    params = SamplingParams(**GREEDY, bad_words=[word])
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    assert word_ids[0] not in out.token_ids and word not in out.text
    first = tokens.index(word_ids[0])
    assert out.token_ids[:first] == tokens[:first]  # the same up to the banned token
