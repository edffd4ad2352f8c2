"""Each RL framework's own ``LLM(...)`` construction and sampling call, copied from its source,
run against dormant's ``LLM`` on the tiny checkpoint, reading back the fields it reads.

Sources read (snapshots of late 2026):
- TRL ``trl/generation/vllm_generation.py`` (trl 1.16.0 as released on PyPI, the version the
  test extra pins),
- verl ``verl/workers/rollout/vllm_rollout/vllm_async_server.py`` and
  ``verl/trainer/config/rollout/rollout.yaml`` (volcengine/verl@b178a3c),
- OpenRLHF ``openrlhf/trainer/ray/vllm_engine.py``, ``openrlhf/trainer/ppo_utils/
  samples_generator.py`` and ``openrlhf/utils/agent.py`` (OpenRLHF/OpenRLHF@3c3be62),
- NeMo-RL ``nemo_rl/models/generation/vllm/vllm_worker.py`` (NVIDIA-NeMo/RL@7ea279a).

Every test also checks the values: each logprob read back is the one of the sampled token under
the model (an independent greedy run's prompt logprobs give the reference where it applies),
so a framework that reads them gets real numbers, not zeros.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from copy import deepcopy
from pathlib import Path

import pytest

from dormant import SamplingParams
from dormant.executors.multiproc import free_port
from tests.engine.conftest import PROMPTS

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(max_model_len=256, kv_cache_memory_bytes=4 << 20)


def assert_sampled_logprobs(completion, num_top: int) -> None:
    """vLLM's shape: one dict per token; the sampled token is in it with its own rank; the
    top ``num_top`` have ranks 1..num_top; logprobs are finite and at most 0."""
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        sampled = position[token_id]
        assert sampled.rank >= 1 and math.isfinite(sampled.logprob) and sampled.logprob <= 0
        top_ranks = sorted(lp.rank for tid, lp in position.items() if tid != token_id)
        if sampled.rank <= num_top:
            assert len(position) == num_top
        else:
            assert len(position) == num_top + 1 and top_ranks == list(range(1, num_top + 1))
        total += sampled.logprob
    assert completion.cumulative_logprob == pytest.approx(total)


def test_trl_colocate(checkpoint: Path, tmp_path: Path) -> None:
    """TRL GRPO, ``vllm_mode="colocate"``: ``LLM(...)`` as vllm_generation.py L347-363 builds
    it (``distributed_executor_backend="external_launcher"``, so one torchrun rank),
    ``SamplingParams(**generation_kwargs)`` of L662-683, ``generate(..., use_tqdm=False)`` of
    L729 on ``{"prompt_token_ids": ids}`` rows (L716), and the fields L731 and
    ``extract_logprobs`` (L70-99) read: ``prompt_token_ids``, ``outputs[j].token_ids``, each
    position's ``{token: Logprob}`` sorted by ``rank``; then ``sleep(level=2)`` (L751)."""
    script = tmp_path / "trl_rank.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, math, sys
        from dormant import LLM, SamplingParams
        llm = LLM(
            model=sys.argv[1], tensor_parallel_size=1, gpu_memory_utilization=0.9,
            max_model_len=None, max_num_seqs=None, enable_sleep_mode=True, model_impl="auto",
            distributed_executor_backend="external_launcher", seed=0 // 1,
            max_num_batched_tokens=4096, logprobs_mode="processed_logprobs",
            quantization=None, trust_remote_code=False, device="cpu",
            kv_cache_memory_bytes=4 << 20,
        )
        generation_kwargs = {{
            "n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "min_p": 0.0, "max_tokens": 16, "logprobs": 0,
        }}
        sampling_params = SamplingParams(**generation_kwargs)
        prompts = {PROMPTS!r}
        vllm_prompts = [{{"prompt_token_ids": ids}} for ids in prompts]
        all_outputs = llm.generate(vllm_prompts, sampling_params=sampling_params, use_tqdm=False)
        prompt_ids = [output.prompt_token_ids for output in all_outputs]
        completion_ids = [output.token_ids for outputs in all_outputs for output in outputs.outputs]
        logprobs, logprob_token_ids = [], []
        for outputs in all_outputs:
            for output in outputs.outputs:
                seq_lp, seq_ids = [], []
                for lp in output.logprobs:
                    items = sorted(lp.items(), key=lambda x: x[1].rank)
                    seq_ids.append([t for t, _ in items])
                    seq_lp.append([None if math.isnan(i.logprob) else i.logprob for _, i in items])
                logprobs.append(seq_lp)
                logprob_token_ids.append(seq_ids)
        llm.sleep(level=2)
        llm.shutdown()
        json.dump([prompt_ids, completion_ids, logprobs, logprob_token_ids], open(sys.argv[2], "w"))
    """)
    )
    result = tmp_path / "trl.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "--master-port", str(free_port()), str(script), str(checkpoint), str(result),
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, timeout=300, cwd=REPO)
    prompt_ids, completion_ids, logprobs, logprob_token_ids = json.loads(result.read_text())
    assert prompt_ids == PROMPTS
    assert all(1 <= len(ids) <= 16 for ids in completion_ids)
    for ids, lps, lp_ids in zip(completion_ids, logprobs, logprob_token_ids, strict=True):
        assert len(lps) == len(ids)  # logprobs=0: the sampled token's alone (inner dim 1)
        assert [row for row in lp_ids] == [[t] for t in ids]
        assert all(row[0] is not None and row[0] <= 0 for row in lps)


def test_verl_sync_llm(make_llm, checkpoint: Path) -> None:
    """verl: the engine args of vllm_async_server.py L264-288 with rollout.yaml's defaults
    (dtype bfloat16 → the checkpoint's float32 here; load_format "dummy"; enforce_eager False;
    enable_chunked_prefill and enable_prefix_caching True; logprobs_mode processed_logprobs;
    disable_log_stats True; scheduling_policy "fcfs"; compilation_config as L260's JSON) through
    the sync ``LLM`` (the async server comes with AsyncLLM), then ``generate`` (L455-521):
    ``SamplingParams(max_tokens=..., temperature, top_p, top_k=-1, repetition_penalty=1.0,
    logprobs=0)`` on a ``TokensPrompt``, reading ``logprobs[token_ids[i]].logprob`` and
    ``finish_reason``."""
    llm = make_llm(
        str(checkpoint),
        load_format="dummy",
        skip_tokenizer_init=False,
        distributed_executor_backend="mp",
        trust_remote_code=False,
        max_num_seqs=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8192,
        enable_prefix_caching=True,
        enable_sleep_mode=True,
        logprobs_mode="processed_logprobs",
        enforce_eager=False,
        gpu_memory_utilization=0.5,
        disable_log_stats=True,
        tensor_parallel_size=1,
        quantization=None,
        scheduling_policy="fcfs",
        compilation_config=json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY"}),
    )
    sampling_params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
    max_tokens = 12
    sampling_params["logprobs"] = 0 if sampling_params.pop("logprobs", True) else None
    params = SamplingParams(max_tokens=max_tokens, **sampling_params)
    final_res = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    token_ids = final_res.outputs[0].token_ids
    log_probs = [lp[token_ids[i]].logprob for i, lp in enumerate(final_res.outputs[0].logprobs)]
    assert len(log_probs) == len(token_ids) and all(x <= 0 for x in log_probs)
    assert final_res.outputs[0].finish_reason in ("stop", "length")
    assert_sampled_logprobs(final_res.outputs[0], num_top=0)


def test_openrlhf(make_llm, checkpoint: Path) -> None:
    """OpenRLHF: the engine kwargs of vllm_engine.py L264-297 (``"uni"`` for TP=1, dtype
    bfloat16 → the checkpoint's float32 here, trust_remote_code, ``logprobs_mode`` with
    ``max_logprobs=1``), samples_generator.py L203-211's ``SamplingParams`` (``top_k=-1``,
    ``max_tokens=None``, ``min_tokens=1``, ``skip_special_tokens=False``, ``logprobs=1``),
    agent.py L217-219 (``params.max_tokens = ...`` on a deepcopy) and L244-263:
    ``prompt_token_ids + action_token_ids`` and ``logprob_dict.get(token_id).logprob``."""
    llm = make_llm(
        str(checkpoint),
        enforce_eager=True,
        tensor_parallel_size=1,
        seed=42,
        distributed_executor_backend="uni",
        enable_prefix_caching=False,
        trust_remote_code=True,
        gpu_memory_utilization=0.5,
        enable_sleep_mode=True,
        logprobs_mode="processed_logprobs",
        max_logprobs=1,
    )
    sampling_params = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=-1, max_tokens=None, min_tokens=1,
        skip_special_tokens=False, logprobs=1,
    )  # fmt: skip
    prompt_token_ids = list(PROMPTS[2])
    max_length = len(prompt_token_ids) + 10
    effective_params = sampling_params
    if sampling_params.max_tokens is None:
        effective_params = deepcopy(sampling_params)
        effective_params.max_tokens = max(1, max_length - len(prompt_token_ids))
    request_output = llm.generate([prompt_token_ids], deepcopy(effective_params), use_tqdm=False)
    generation_output = request_output[0].outputs[0]
    action_token_ids = generation_output.token_ids
    is_truncated = generation_output.finish_reason == "length"
    observation_token_ids = prompt_token_ids + action_token_ids
    rollout_log_probs = [0.0] * len(prompt_token_ids)
    for token_id, logprob_dict in zip(action_token_ids, generation_output.logprobs, strict=True):
        token_logprob = logprob_dict.get(token_id)
        rollout_log_probs.append(token_logprob.logprob if token_logprob is not None else 0.0)
    assert len(observation_token_ids) <= max_length and len(action_token_ids) >= 1
    assert is_truncated == (len(action_token_ids) == 10)
    assert all(lp < 0 for lp in rollout_log_probs[len(prompt_token_ids) :])
    assert_sampled_logprobs(generation_output, num_top=1)
    assert sampling_params.max_tokens is None  # the caller's object was not changed
    with pytest.raises(ValueError, match="max_logprobs=1"):
        llm.generate([prompt_token_ids], SamplingParams(logprobs=2), use_tqdm=False)


def test_nemo_rl(make_llm, checkpoint: Path) -> None:
    """NeMo-RL: ``vllm.LLM(**llm_kwargs)`` of vllm_worker.py L570-601 (``served_model_name``,
    ``load_format``, ``skip_tokenizer_init``, ``pipeline_parallel_size=1``,
    ``enable_expert_parallel=False``, ``disable_log_stats=False``; the backend resolves to None
    for TP=1), ``_build_sampling_params`` L640-667 (greedy: ``temperature=0``, ``top_k=1``;
    ``logprobs=0``, ``stop_token_ids=None``, ``stop=None``, ``include_stop_str_in_output=True``,
    ``bad_words=None``), and ``generate(prompts, sampling_params, use_tqdm=...)`` reading
    ``outputs[0].token_ids`` and ``logprob_dict.get(token_id).logprob``."""
    llm = make_llm(
        str(checkpoint),
        served_model_name=str(checkpoint),
        load_format="auto",
        skip_tokenizer_init=True,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        enable_expert_parallel=False,
        gpu_memory_utilization=0.5,
        enable_prefix_caching=True,
        dtype="float32",
        seed=0,
        enforce_eager=False,
        trust_remote_code=True,
        enable_sleep_mode=True,
        disable_log_stats=False,
        distributed_executor_backend=None,
    )
    params = SamplingParams(
        temperature=0.0, top_p=1.0, top_k=1, max_tokens=8, logprobs=0, stop_token_ids=None,
        stop=None, include_stop_str_in_output=True, bad_words=None, ignore_eos=False,
    )  # fmt: skip
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    # The reference: each greedy token's logprob is the prompt logprob of that position when
    # the prompt is extended by the generated tokens.
    check = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        generation = output.outputs[0]
        generated_tokens = list(generation.token_ids)
        assert generation.text == ""  # skip_tokenizer_init: no text
        values = [generation.logprobs[i].get(t).logprob for i, t in enumerate(generated_tokens)]
        assert [generation.logprobs[i][t].rank for i, t in enumerate(generated_tokens)] == [
            1
        ] * len(generated_tokens)  # greedy tokens are the most likely ones
        full = llm.generate([[*prompt, *generated_tokens]], check, use_tqdm=False)[0]
        reference = [
            full.prompt_logprobs[len(prompt) + i][t] for i, t in enumerate(generated_tokens)
        ]
        assert values == pytest.approx([r.logprob for r in reference], abs=1e-4)
        assert generation.logprobs[0][generated_tokens[0]].decoded_token is None
