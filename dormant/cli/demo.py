"""``dormant demo``: the RL cycle a trainer colocated with dormant runs, on a random model.

    generate → sleep(1) → wake → generate              tokens must be identical
    sleep(level) → a stand-in training step takes most of the freed memory, then frees it
    → wake_up(["weights"]) → update_weights(new weights) → wake_up(["kv_cache"]) → generate
    → a fresh engine loaded from a checkpoint of the new weights must produce the same tokens

It prints what each step freed and restored, its time against the copy-bandwidth limit, and
writes a memory timeline.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from dormant import LLM, SamplingParams
from dormant.cli.demo_report import Timeline, copy_limits, print_report
from dormant.models import ModelConfig, build_model

SIZES = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
    ),
    "small": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32768,
    ),
}
# The MoE family (Qwen3-MoE): the dense sizes' attention, experts in every layer.
MOE_SIZES = {
    "tiny": dict(
        num_hidden_layers=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128
    ),
    "small": dict(
        num_hidden_layers=12, num_experts=32, num_experts_per_tok=8, moe_intermediate_size=768
    ),
}
PROMPTS = [
    "The trainer and the engine share one GPU.",
    "Sleep, then wake bit-exact.",
    "Graphs keep their addresses.",
]
# As token ids (UTF-8 bytes): the checkpoint written for the fresh engine has no tokenizer.
PROMPT_IDS = [{"prompt_token_ids": list(p.encode())} for p in PROMPTS]
PARAMS = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True)


def hf_config(size: str, on_gpu: bool, family: str = "dense") -> dict[str, object]:
    moe: dict[str, object] = {}
    if family == "moe":
        moe = {**MOE_SIZES[size], "norm_topk_prob": True, "decoder_sparse_step": 1}
    return {
        "architectures": ["Qwen3MoeForCausalLM" if family == "moe" else "Qwen3ForCausalLM"],
        "head_dim": 128 if size == "small" else 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16" if on_gpu else "float32",
        "eos_token_id": 0,
        **SIZES[size],
        **moe,
    }


def trainer_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """What a trainer would send after a step: every weight, HF-named, in the model dtype."""
    with torch.device("meta"):
        shapes = build_model(config).expected_weight_shapes()
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            tensor = 0.05 * torch.randn(shape, generator=generator)
        weights[name] = tensor.to(config.dtype)
    return weights


def stand_in_training_step(device: torch.device, free_bytes: int) -> int:
    """Allocates and touches most of the freed memory, then releases it; returns the bytes."""
    nbytes = int(free_bytes * 0.9)
    if nbytes <= 0:
        return 0
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
    scratch.fill_(1)
    del scratch
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return nbytes


def run_demo(device: str, level: int, size: str | None, png: str, family: str = "dense") -> int:
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    size = size or ("small" if on_gpu else "tiny")
    raw = hf_config(size, on_gpu, family)
    config = ModelConfig.from_dict(raw)
    options: dict[str, object] = dict(
        device="cuda" if on_gpu else "cpu", max_model_len=512, max_num_seqs=16
    )
    if not on_gpu:
        options["kv_cache_memory_bytes"] = 256 << 20
    else:
        options["gpu_memory_utilization"] = 0.5
    print(
        f"dormant demo: {size} random {'Qwen3-MoE' if family == 'moe' else 'Qwen3'} on "
        f"{'GPU' if on_gpu else 'CPU (host backend)'}, "
        f"RL cycle at sleep level {level}",
        flush=True,
    )
    timeline, steps = Timeline(), []
    llm = LLM(config, seed=0, **options)
    status = llm.memory_status()[0]
    timeline.mark("loaded", status)
    torch_device = torch.device("cuda" if on_gpu else "cpu")

    first = [o.outputs[0].token_ids for o in llm.generate(PROMPT_IDS, PARAMS, use_tqdm=False)]
    awake = llm.memory_status()[0]
    llm.sleep(level=1)
    asleep = llm.memory_status()[0]
    timeline.mark("sleep(1)", asleep)
    llm.wake_up()
    woken = llm.memory_status()[0]
    timeline.mark("wake_up()", woken)
    steps.append(("sleep(level=1)", awake, asleep, asleep.last_sleep))
    steps.append(("wake_up()", asleep, woken, woken.last_wake))
    same = [
        o.outputs[0].token_ids for o in llm.generate(PROMPT_IDS, PARAMS, use_tqdm=False)
    ] == first

    before = llm.memory_status()[0]
    llm.sleep(level=level)
    asleep = llm.memory_status()[0]
    timeline.mark(f"sleep({level})", asleep)
    steps.append((f"sleep(level={level})", before, asleep, asleep.last_sleep))
    free = (
        asleep.device_total_bytes - asleep.device_used_bytes
        if on_gpu
        else before.device_used_bytes - asleep.device_used_bytes
    )
    trained = stand_in_training_step(torch_device, free)
    timeline.mark("training step", llm.memory_status()[0], trained)
    timeline.mark("trainer done", llm.memory_status()[0])

    new_weights = trainer_weights(config, seed=1)
    start = llm.memory_status()[0]
    llm.wake_up(["weights"])
    after_weights = llm.memory_status()[0]
    timeline.mark("wake weights", after_weights)
    steps.append(('wake_up(["weights"])', start, after_weights, after_weights.last_wake))
    refit_start = time.perf_counter()
    llm.update_weights(new_weights)
    refit_s = time.perf_counter() - refit_start
    llm.wake_up(["kv_cache"])
    after_kv = llm.memory_status()[0]
    timeline.mark("wake kv_cache", after_kv)
    steps.append(('wake_up(["kv_cache"])', after_weights, after_kv, after_kv.last_wake))
    refit_tokens = [
        o.outputs[0].token_ids for o in llm.generate(PROMPT_IDS, PARAMS, use_tqdm=False)
    ]
    llm.shutdown()  # frees its memory: the fresh engine below gets the same device

    with tempfile.TemporaryDirectory() as checkpoint:
        Path(checkpoint, "config.json").write_text(json.dumps(raw))
        save_file(new_weights, str(Path(checkpoint, "model.safetensors")))
        fresh = LLM(checkpoint, seed=0, skip_tokenizer_init=True, **options)
        fresh_tokens = [
            o.outputs[0].token_ids for o in fresh.generate(PROMPT_IDS, PARAMS, use_tqdm=False)
        ]
        fresh.shutdown()

    weight_bytes = sum(t.numel() * t.element_size() for t in new_weights.values())
    print_report(
        steps=steps,
        limits=copy_limits(torch_device),
        refit=(refit_s, weight_bytes),
        checks={
            "tokens identical after sleep(1) → wake_up()": same,
            "tokens after the refit equal a fresh engine with the new weights": refit_tokens
            == fresh_tokens,
            "the refit changed the tokens": refit_tokens != first,
        },
        timeline=timeline,
        png=png,
    )
    return 0 if same and refit_tokens == fresh_tokens else 1
