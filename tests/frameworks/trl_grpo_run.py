"""TRL 1.16's GRPOTrainer in colocate mode with sleep mode on, over dormant installed as vllm:
a few steps on a tiny Qwen3 in fp32 on the CPU. Run by ``test_trl_grpo.py`` in its own
interpreter (``install_as_vllm`` and TRL's rank variables are process-wide); prints one JSON
line with what the test asserts."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dormant

dormant.install_as_vllm()  # the two lines a TRL user adds, before trl is imported

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer, Qwen3ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from dormant.models import build_model  # noqa: E402
from tests.engine.conftest import (  # noqa: E402
    hf_config,
    write_checkpoint,
    write_tokenizer,
)

# The bf16 run's model (issue 15: "a slightly larger model" than CI's): about 30M parameters.
GPU_MODEL = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, initializer_range=0.02,
)  # fmt: skip


def timed(timings: dict[str, list[float]], name: str, function: Callable[..., Any]) -> Callable:
    """``function``, recording the wall time of each call (device work included) under name."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = function(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timings.setdefault(name, []).append(round(time.perf_counter() - start, 5))
        return result

    return wrapper


def length_reward(completions: list[str], **_: object) -> list[float]:
    return [float(len(c)) for c in completions]


def main(workdir: Path, on_gpu: bool) -> None:
    """On the CPU in fp32 (CI), or with ``--gpu`` on one GPU in bf16."""
    path = write_checkpoint(workdir / "ckpt", seed=1)
    if on_gpu:  # a larger bf16 checkpoint: vLLM's (and dormant's) dtype "auto" follows it
        config = hf_config(torch_dtype="bfloat16", **GPU_MODEL)
        config.save_pretrained(path)
        torch.manual_seed(1)
        policy = Qwen3ForCausalLM(config)
        state = {k: v.to(torch.bfloat16).contiguous() for k, v in policy.state_dict().items()}
        save_file(state, str(path / "model.safetensors"))
    write_tokenizer(path)
    prompts = ["ab cd", "hello there", "xy", "the cat sat", "on the mat", "a b c", "zz", "qq"]
    args = GRPOConfig(
        output_dir=str(workdir / "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, max_steps=3, use_vllm=True, vllm_mode="colocate",
        vllm_enable_sleep_mode=True, use_cpu=not on_gpu, report_to=[], logging_steps=1,
        bf16=on_gpu, save_strategy="no", seed=0, vllm_gpu_memory_utilization=0.3,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(path), reward_funcs=length_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(str(path)),
    )  # fmt: skip
    generation = trainer.vllm_generation
    timings: dict[str, list[float]] = {}
    for name in ("sleep", "wake_up"):
        setattr(generation.llm, name, timed(timings, name, getattr(generation.llm, name)))
    generation.sync_weights = timed(timings, "sync_weights", generation.sync_weights)
    trainer.train()
    steps = [row for row in trainer.state.log_history if "loss" in row]
    generation.sync_weights()  # TRL's own weight sync, then compare the engine's weights
    engine_model = generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    # The policy's HF-named tensors, written into a fresh model of the engine's layout (fused
    # qkv and gate/up), must equal the engine's tensors bit for bit.
    with torch.device(next(engine_model.parameters()).device):
        reference = build_model(engine_model.config)
    reference.init_buffers()
    reference.load_weights((n, p.detach()) for n, p in trainer.model.named_parameters())
    expected = dict(reference.named_parameters())
    engine_state = dict(engine_model.named_parameters())
    max_delta = max(
        float((engine_state[name] - expected[name]).abs().max()) for name in engine_state
    )
    print(
        json.dumps(
            {
                "num_steps": len(steps),
                "is_ratio_mean": [row["sampling/importance_sampling_ratio/mean"] for row in steps],
                "is_ratio_min": [row["sampling/importance_sampling_ratio/min"] for row in steps],
                "is_ratio_max": [row["sampling/importance_sampling_ratio/max"] for row in steps],
                "loss": [row["loss"] for row in steps],
                "grad_norm": [row["grad_norm"] for row in steps],
                "max_weight_delta": max_delta,
                "weights_compared": len(engine_state),
                "is_sleeping_after_sync": generation.llm.is_sleeping(),
                "timings_s": timings,
                "num_parameters": sum(p.numel() for p in trainer.model.parameters()),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), on_gpu="--gpu" in sys.argv[2:])
