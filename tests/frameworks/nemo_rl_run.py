"""NeMo-RL's engine calls over dormant installed as vllm, in their order (the table and line
citations are in ``test_nemo_rl_calls.py``). Run by that test in its own interpreter
(``install_as_vllm`` is process-wide); prints one JSON line with what the test asserts.

    python tests/frameworks/nemo_rl_run.py WORKDIR
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

import dormant

dormant.install_as_vllm()  # before NeMo-RL's `import vllm`

import vllm  # noqa: E402
from vllm.logger import init_logger  # noqa: E402  (vw L356)

from dormant.core.errors import EngineAsleepError  # noqa: E402
from dormant.executors.multiproc import free_port  # noqa: E402
from tests.engine.conftest import PROMPTS, write_checkpoint  # noqa: E402
from tests.frameworks.nemo_rl_collective import EXTENSION, trainer_main  # noqa: E402

logger = init_logger("vllm_load_model")
EOS_TOKEN_ID = 0  # the fixture tokenizer's <|endoftext|>; gen L43-44 stops on it
# NeMo-RL's generation config (examples/configs/grpo_math_1B.yaml L364-435): temperature and
# top_p 1.0, top_k null, stop_strings null; max_new_tokens shortened for the test.
CFG = dict(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=10,
           stop_token_ids=[EOS_TOKEN_ID], bad_words=None, ignore_eos=False)  # fmt: skip


def llm_kwargs(model: Path, load_format: str) -> dict[str, Any]:
    """vw L570-601 with vllm_cfg's defaults; dtype is the checkpoint's float32 (NeMo-RL:
    the policy's precision). The last line sizes the engine for the CPU (dormant's options)."""
    kwargs: dict[str, Any] = dict(
        model=str(model), served_model_name=str(model), load_format=load_format,
        skip_tokenizer_init=True, tensor_parallel_size=1, pipeline_parallel_size=1,
        enable_expert_parallel=False, gpu_memory_utilization=0.6, enable_prefix_caching=True,
        dtype="float32", seed=0, enforce_eager=False, max_model_len=256,
        trust_remote_code=True, worker_extension_cls=EXTENSION, enable_sleep_mode=True,
        disable_log_stats=False, distributed_executor_backend=None, hf_overrides={},
        device="cpu", kv_cache_memory_bytes=4 << 20,
    )  # fmt: skip
    kwargs["logprobs_mode"] = "processed_logprobs"
    return kwargs


def sampling_params(greedy: bool) -> Any:
    """vw L641-668."""
    top_k_cfg = CFG["top_k"]
    top_k_val = 1 if greedy else (top_k_cfg if top_k_cfg is not None else -1)
    return vllm.SamplingParams(
        temperature=0.0 if greedy else CFG["temperature"], top_p=CFG["top_p"], top_k=top_k_val,
        max_tokens=CFG["max_new_tokens"], logprobs=0, stop_token_ids=CFG["stop_token_ids"],
        stop=None, include_stop_str_in_output=True, bad_words=CFG["bad_words"],
        ignore_eos=CFG["ignore_eos"],
    )  # fmt: skip


def generate(llm: Any, greedy: bool) -> tuple[list[list[int]], list[list[float]]]:
    """vw L930-991: token ids out, and each generated token's logprob (zero where missing,
    as NeMo-RL fills them)."""
    prompts = [{"prompt_token_ids": list(ids)} for ids in PROMPTS]
    outputs = llm.generate(prompts, sampling_params(greedy), use_tqdm=True)
    tokens, logprobs = [], []
    for output in outputs:
        generation = output.outputs[0]
        generated_tokens = list(generation.token_ids)
        full_logprobs = [0.0] * len(generated_tokens)
        if hasattr(generation, "logprobs") and generation.logprobs:
            for idx, (token_id, logprob_dict) in enumerate(
                zip(generated_tokens, generation.logprobs, strict=True)
            ):
                if logprob_dict:
                    sampled_logprob = logprob_dict.get(token_id)
                    if sampled_logprob is not None:
                        full_logprobs[idx] = sampled_logprob.logprob
        tokens.append(generated_tokens)
        logprobs.append(full_logprobs)
    return tokens, logprobs


def raw_spec_counters(llm: Any) -> dict[str, Any]:
    """vw L762-786, what ``snapshot_step_metrics`` and ``get_step_metrics`` read around every
    GRPO step's generation (grpo L2924-2928, L3107-3109): each metric's value by name."""
    metrics: dict[str, Any] = {}
    if hasattr(llm, "get_metrics"):
        vllm_prom_metrics = llm.get_metrics()
    else:
        from vllm.v1.metrics.reader import get_metrics_snapshot

        vllm_prom_metrics = get_metrics_snapshot()
    for metric in vllm_prom_metrics:
        if hasattr(metric, "values"):
            metrics[metric.name] = metric.values
        elif hasattr(metric, "value"):
            metrics[metric.name] = metric.value
    return metrics


def finish_generation(llm: Any) -> None:
    """vg L1004-1029 → vw L1286-1312."""
    llm.llm_engine.reset_prefix_cache()
    if hasattr(llm, "renderer") and hasattr(llm.renderer, "clear_mm_cache"):
        llm.renderer.clear_mm_cache()
    llm.sleep(level=1)


def prepare_for_generation(llm: Any, **kwargs: Any) -> None:
    """vg L980-1002 → vw L1314-1331."""
    tags = kwargs.get("tags")
    wake_up_args = {}
    if tags is not None:
        wake_up_args["tags"] = tags
    llm.wake_up(**wake_up_args)


class Trainer:
    """The trainer process of the weight-update group (rank 0; the engine is rank 1)."""

    def __init__(self, seeds: list[int]) -> None:
        self.port = free_port()
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=trainer_main, args=(self.port, 2, seeds, child), daemon=True
        )  # a failed run exits at once instead of waiting on a trainer that waits on it
        self.process.start()
        self.state_dict_info = self.conn.recv()

    def join(self, llm: Any) -> None:
        """grpo L1569-1583 (ip, port, world_size, train_world_size), then vg L1045-1062."""
        llm.collective_rpc("init_collective", args=(0, "127.0.0.1", self.port, 2, 1))
        llm.collective_rpc("prepare_refit_info", args=(self.state_dict_info,))

    def refit(self, llm: Any) -> tuple[list[bool], int]:
        """grpo L2396-2403: the trainer broadcasts while every engine rank receives."""
        self.conn.send("broadcast")
        results = llm.collective_rpc("update_weights_from_collective", args=tuple())
        return results, self.conn.recv()

    def close(self, llm: Any) -> None:
        llm.collective_rpc("cleanup", args=tuple())
        self.conn.send("done")
        self.process.join(timeout=60)


def asleep(llm: Any) -> list[str]:
    (status,) = llm.memory_status()
    return sorted(tag.tag for tag in status.tags if tag.state != "awake")


def fresh(workdir: Path, seed: int) -> dict[str, Any]:
    path = write_checkpoint(workdir / f"ckpt{seed}", seed, with_tokenizer=False)
    llm = vllm.LLM(**llm_kwargs(path, "auto"))
    try:
        tokens, logprobs = generate(llm, greedy=True)
    finally:
        llm.shutdown()
    return {"greedy_tokens": tokens, "greedy_logprobs": logprobs}


def main(workdir: Path) -> dict[str, Any]:
    """Two GRPO steps (seeds 2 and 3), then a third (seed 2 again) whose calls come in the
    wrong order first: generate after finish_generation, and after waking only the weights."""
    base = write_checkpoint(workdir / "ckpt1", 1, with_tokenizer=False)
    report: dict[str, Any] = {"fresh": {str(s): fresh(workdir, s) for s in (2, 3)}, "steps": {}}
    llm = vllm.LLM(**llm_kwargs(base, "dummy"))
    report["vllm_is_dormant"] = isinstance(llm, dormant.LLM)
    report["device_ids"] = llm.collective_rpc("report_device_id", args=tuple())
    finish_generation(llm)  # grpo L1190: the engine sleeps until the first refit
    report["init_asleep"] = asleep(llm)
    trainer = Trainer([2, 3, 2])
    try:
        trainer.join(llm)
        for seed in (2, 3):
            prepare_for_generation(llm, tags=["weights"])
            results, num_packs = trainer.refit(llm)
            prepare_for_generation(llm, tags=["kv_cache"])
            step: dict[str, Any] = {"update_results": results, "num_packs": num_packs}
            step["asleep_after"], step["is_sleeping"] = asleep(llm), llm.is_sleeping()
            step["metrics_before"] = raw_spec_counters(llm)
            step["greedy_tokens"], step["greedy_logprobs"] = generate(llm, greedy=True)
            _, sampled = generate(llm, greedy=False)
            step["metrics_after"] = raw_spec_counters(llm)
            step["sampled_logprobs"] = sampled
            step["nonzero_logprobs"] = all(any(lp != 0 for lp in row) for row in sampled)
            report["steps"][str(seed)] = step
            finish_generation(llm)
        report["asleep_after_finish"] = asleep(llm)
        report["wrong_order"] = wrong_order(llm, trainer)
        trainer.close(llm)
    finally:
        llm.shutdown()
    return report


def wrong_order(llm: Any, trainer: Trainer) -> dict[str, Any]:
    report: dict[str, Any] = {"after_sleep": refusal(llm)}
    before = asleep(llm)
    prepare_for_generation(llm, tags=["weights"])
    report["refit_results"] = trainer.refit(llm)[0]
    report["after_weights_only"] = refusal(llm)
    report["asleep_after_refusal"] = asleep(llm)
    report["asleep_before_refusal"] = before
    prepare_for_generation(llm, tags=["kv_cache"])
    report["tokens_after_kv_wake"] = generate(llm, greedy=True)[0]
    report["is_sleeping"] = llm.is_sleeping()
    return report


def refusal(llm: Any) -> str | None:
    """The typed error NeMo-RL's generate gets, if any (the engine must queue nothing)."""
    try:
        generate(llm, greedy=True)
    except EngineAsleepError as error:
        assert not llm.llm_engine.has_unfinished_requests()
        return type(error).__name__
    return None


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
