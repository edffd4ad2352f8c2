"""``shutdown()`` gives the device memory back while the ``LLM`` object still lives, for plain and
speculative engines (random weights from a ``ModelConfig``, as ``benchmarks/spec_decode.py``
makes them).

Regression: on the H200, every speculative engine of ``benchmarks/spec_decode.py`` kept about
both models' weights in use after ``shutdown()`` until the object was dropped (the next engine of
the loop, made while the last was still bound to ``llm``, found ~7000 KV blocks fewer). The CPU
test (``tests/engine/test_lifecycle.py``) follows weak references to the weights; this one reads
the device's free memory, so it sees whatever holds it. On failure it prints what is alive."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.models import ModelConfig

pytestmark = pytest.mark.gpu
MiB, GiB = 1 << 20, 1 << 30
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": 2,
}  # fmt: skip  (about 1 GiB of bf16 weights)
# Kernels loaded, cuBLAS handles and graph executables stay with the process (issue 17's
# residual rows): a few hundred MiB at most; the weights alone are 1 GiB, the KV cache 1 GiB.
SLACK_BYTES = 400 * MiB
CASES = {
    "plain": {},
    "draft, rounds": {"draft": True},
    "draft, one round per step": {"draft": True, "cuda_graph_multi_steps": 1},
    "draft, eager draft": {"draft": True, "cuda_graph_multi_steps": 1, "draft_eager": True},
}


def make(case: dict[str, Any]) -> LLM:
    target = ModelConfig.from_dict(CONFIG)
    options: dict[str, Any] = dict(
        device="cuda", max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=GiB,
        cuda_graph_multi_steps=case.get("cuda_graph_multi_steps", 4),
    )  # fmt: skip
    if case.get("draft"):
        options["speculative_config"] = {
            "model": target, "num_speculative_tokens": 3,
            "enforce_eager": case.get("draft_eager", False),
        }  # fmt: skip
    return LLM(target, **options)


def free_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def live_cuda_tensors(limit: int = 12) -> list[str]:
    """The largest CUDA tensors reachable by the garbage collector, with their referrers' types."""
    found = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                found.append(obj)
        except Exception:  # objects whose isinstance check fails (lazy proxies)
            continue
    found.sort(key=lambda t: t.untyped_storage().nbytes(), reverse=True)
    rows = []
    for tensor in found[:limit]:
        referrers = sorted({type(r).__name__ for r in gc.get_referrers(tensor)} - {"list"})
        rows.append(
            f"{tuple(tensor.shape)} {tensor.dtype} storage "
            f"{tensor.untyped_storage().nbytes() / MiB:.1f} MiB, held by {referrers}"
        )
    return rows


@pytest.mark.parametrize("name", list(CASES))
def test_shutdown_gives_the_memory_back_while_the_llm_lives(name: str) -> None:
    before = free_bytes()
    llm = make(CASES[name])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9]] * 4, params, use_tqdm=False)
    llm.shutdown()
    after = free_bytes()
    kept = before - after
    detail = {
        "kept_MiB": round(kept / MiB, 1),
        "torch_allocated_MiB": round(torch.cuda.memory_allocated() / MiB, 1),
        "torch_reserved_MiB": round(torch.cuda.memory_reserved() / MiB, 1),
        "live_cuda_tensors": live_cuda_tensors(),
    }
    print(name, detail)
    del llm
    dropped = free_bytes()
    print(name, "after the LLM was dropped, kept MiB:", round((before - dropped) / MiB, 1))
    assert kept <= SLACK_BYTES, detail
