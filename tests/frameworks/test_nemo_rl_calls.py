"""NeMo-RL's rollout calls, in NeMo-RL's order, against dormant's ``LLM`` (issue #15).

NeMo-RL does ``import vllm`` itself, so the engine comes from ``dormant.install_as_vllm()``
(the test runs in its own interpreter: the registration is process-wide). Read from
NVIDIA-NeMo/RL@7ea279abfbeb698b092856d0dab61e7cf39bc909 (``vw`` below is
``nemo_rl/models/generation/vllm/vllm_worker.py``, ``vg`` is ``vllm_generation.py`` beside it,
``grpo`` is ``nemo_rl/algorithms/grpo.py``, ``gen`` is ``nemo_rl/models/generation/__init__.py``):

    step                          NeMo-RL's call                                   where
    ────────────────────────────  ───────────────────────────────────────────────  ───────────
    start the engine              vllm.LLM(**llm_kwargs): model,                    vw L570-609,
                                  served_model_name, load_format "dummy",          L817; gen
                                  skip_tokenizer_init, TP/PP 1, no expert          L43-49,
                                  parallel, enable_prefix_caching, dtype, seed,    L93-100
                                  enforce_eager, trust_remote_code,
                                  worker_extension_cls, enable_sleep_mode,
                                  disable_log_stats=False, hf_overrides={},
                                  distributed_executor_backend=None,
                                  logprobs_mode
                                  collective_rpc("report_device_id", args=())      vw L1150
    init_vllm → finish_generation llm.llm_engine.reset_prefix_cache(), then        grpo L1190,
                                  llm.sleep(level=1)                               vw L1297-1309
    weight-update group           collective_rpc("init_collective", args=(         grpo L1577-
                                  rank_prefix, ip, port, world_size,               1583, vw
                                  train_world_size))                               L838-847
                                  collective_rpc("prepare_refit_info",             vw L1157
                                  args=(state_dict_info,))
    refit_policy_generation       prepare_for_generation(tags=["weights"]) →       grpo L2343,
                                  llm.wake_up(tags=["weights"])                    vw L1325-1331
                                  collective_rpc("update_weights_from_collective", grpo L2399,
                                  args=()), every rank True                        vw L1204-1214
                                  prepare_for_generation(tags=["kv_cache"])        grpo L2417
    step metrics, around          llm.get_metrics() if the engine has it, else     vg L546-599,
    generation                    vllm.v1.metrics.reader.get_metrics_snapshot();   vw L762-786,
                                  metric.name, .value / .values                    grpo L2924-
                                                                                   2928, L3107-
                                                                                   3109
    generate                      SamplingParams(temperature, top_p, top_k,        vw L641-668
                                  max_tokens, logprobs=0, stop_token_ids=[eos],
                                  stop=None, include_stop_str_in_output=True,
                                  bad_words=None, ignore_eos=False)
                                  llm.generate([{"prompt_token_ids": ids}], ...,   vw L930-932,
                                  use_tqdm=True)                                   utils L85-93
                                  outputs[0].token_ids,                            vw L948-991
                                  logprob_dict.get(token_id).logprob
    finish_generation             reset_prefix_cache() then sleep(level=1) again   grpo L3011
    shutdown                      collective_rpc("cleanup", args=())               vw L1341

NeMo-RL refits a *colocated* engine over CUDA IPC (ZMQ) and a non-colocated one over the
collective; the issue asks for the staged wakes with the collective, which is what runs here
(gloo on the CPU; the collective's NCCL run needs a GPU per rank). The extension and the
trainer are in ``nemo_rl_collective.py``. Not taken: ``bind_numa`` (NUMA pinning), the FP8 and
draft-model branches of the extension's ``_load_weights``, and vLLM's
``process_weights_after_loading`` (dormant's ``load_weights`` leaves nothing to post-process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_script(name: str, workdir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    script = REPO / "tests/frameworks" / name
    result = subprocess.run(
        [sys.executable, str(script), str(workdir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of ``nemo_rl_run.py``: one engine, one trainer process, three refits."""
    return run_script("nemo_rl_run.py", tmp_path_factory.mktemp("nemo_rl"))


@pytest.fixture(scope="module")
def async_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of ``nemo_rl_async_run.py``: the async engine, one trainer process, two refits."""
    return run_script("nemo_rl_async_run.py", tmp_path_factory.mktemp("nemo_rl_async"))


def test_nemo_rl_grpo_cycles_refit_over_a_collective(report: dict) -> None:
    """Two GRPO steps: finish_generation (level-1 sleep), the staged wakes around a packed
    broadcast from a trainer process, then NeMo-RL's generate; the tokens and logprobs equal
    a fresh engine's on the broadcast weights, nothing is left asleep."""
    assert report["vllm_is_dormant"] and report["device_ids"] == ["cpu"]
    # finish_generation: level 1 (weights and runtime offloaded, the KV cache discarded)
    assert {"kv_cache", "weights"} <= set(report["init_asleep"])
    for seed in ("2", "3"):
        step = report["steps"][seed]
        assert step["update_results"] == [True] and step["num_packs"] > 1
        assert step["asleep_after"] == [] and step["is_sleeping"] is False
        assert step["greedy_tokens"] == report["fresh"][seed]["greedy_tokens"]
        for got, want in zip(
            step["greedy_logprobs"], report["fresh"][seed]["greedy_logprobs"], strict=True
        ):
            assert got == pytest.approx(want, abs=1e-5)
        assert all(lp <= 0 for row in step["sampled_logprobs"] for lp in row)
        assert all(len(row) > 0 for row in step["sampled_logprobs"])
        assert step["nonzero_logprobs"]  # real values, not NeMo-RL's zero fill
        # Regression: dormant's LLM had no get_metrics, so NeMo-RL imported vLLM's reader and
        # every GRPO step failed. No speculative decoding: no spec_decode counters, as vLLM.
        for metrics in (step["metrics_before"], step["metrics_after"]):
            assert metrics["vllm:num_requests_running"] == 0
            assert metrics["vllm:num_requests_waiting"] == 0
            assert 0.0 <= metrics["vllm:kv_cache_usage_perc"] <= 1.0
            assert not any("spec_decode" in name for name in metrics)
    assert report["fresh"]["2"]["greedy_tokens"] != report["fresh"]["3"]["greedy_tokens"]
    assert report["asleep_after_finish"] == report["init_asleep"]


def test_nemo_rl_calls_in_the_wrong_order_get_typed_errors(report: dict) -> None:
    """The third step, out of order: generating after finish_generation, and after waking
    only the weights (the refit done, the KV cache still asleep), raises EngineAsleepError and
    queues nothing; waking the KV cache then generates the new weights' tokens."""
    wrong = report["wrong_order"]
    assert wrong["after_sleep"] == "EngineAsleepError"
    assert wrong["refit_results"] == [True]
    assert wrong["after_weights_only"] == "EngineAsleepError"
    assert wrong["asleep_after_refusal"] == ["kv_cache"]  # the refusal woke or slept nothing
    assert wrong["asleep_before_refusal"] == report["init_asleep"]
    assert wrong["tokens_after_kv_wake"] == report["fresh"]["2"]["greedy_tokens"]
    assert wrong["is_sleeping"] is False


def test_nemo_rl_async_engine_cycles_refit_over_a_collective(async_report: dict) -> None:
    """``async_engine: true`` (``nemo_rl_async_run.py`` has the call table). Regression: the
    async worker's engine start imports ``vllm.config``, ``vllm.engine.arg_utils`` and
    ``vllm.v1.metrics.loggers``, which ``install_as_vllm`` did not provide, and its refit and
    step metrics call ``reset_encoder_cache`` and ``get_metrics``, which ``AsyncLLM`` lacked.
    Two steps: the tokens and logprobs equal a fresh engine's on the broadcast weights; the
    engine sleeps again after each; a stat logger is refused before an engine starts."""
    report = async_report
    assert report["vllm_is_dormant"] and report["device_ids"] == ["cpu"]
    for step, fresh in zip(report["steps"], report["fresh"], strict=True):
        assert step["update_results"] == [True] and step["is_sleeping"] is False
        assert step["greedy_tokens"] == fresh["greedy_tokens"]
        for got, want in zip(step["greedy_logprobs"], fresh["greedy_logprobs"], strict=True):
            assert got == pytest.approx(want, abs=1e-5)
        assert step["truncated"] == [True] * len(step["greedy_tokens"])  # max_tokens reached
        assert all(routed == [None, None] for routed in step["routed_experts"])
        assert all(lp < 0 for row in step["sampled_logprobs"] for lp in row)
        for metrics in (step["metrics_before"], step["metrics_after"]):
            assert metrics["vllm:num_requests_running"] == 0
            assert not any("spec_decode" in name for name in metrics)
    assert report["fresh"][0]["greedy_tokens"] != report["fresh"][1]["greedy_tokens"]
    assert {"weights", "kv_cache"} <= set(report["asleep_after_finish"])
    assert "enable_vllm_metrics_logger=false" in report["stat_logger_refusal"]
