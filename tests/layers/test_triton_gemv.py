"""The skinny GEMV and the batch-1 PDL GEMV (``triton_gemv.py``) on the CPU, through Triton's
interpreter (a subprocess: ``TRITON_INTERPRET`` is read when triton is imported), and which
layers opt in to them. The same
checks run on the GPU in tests/gpu/test_triton_moe.py, bf16, model sizes and graphs included.
fp32 and fp16 only here: the interpreter casts float32 to bf16 by truncating.
"""

from __future__ import annotations

import pytest
import torch

from dormant.layers.linear import LinearBase
from dormant.models import ModelConfig, build_model
from tests.triton_interpreter import run_interpreted

SCRIPT = """
import torch
from tests.layers import moe_gemv_checks as checks
for shape in checks.GEMV_SHAPES:
    for dtype in (torch.float32, torch.float16):
        checks.check_exact(shape, dtype, "cpu")
        checks.check_random(shape, dtype, "cpu")
    print("ok", shape)
checks.check_bad_inputs_raise("cpu")
print("ok errors")
for shape in checks.PDL_GEMV_SHAPES:
    for dtype in (torch.float32, torch.float16):
        checks.check_pdl_gemv(shape, dtype, "cpu")
    print("ok pdl", shape)
checks.check_pdl_gemv_bad_inputs_raise("cpu")
print("ok pdl errors")
"""

_TINY = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "torch_dtype": "float32",
}  # fmt: skip
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def test_the_skinny_gemv_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    from tests.layers.moe_gemv_checks import GEMV_SHAPES, PDL_GEMV_SHAPES

    expected = len(GEMV_SHAPES) + 1 + len(PDL_GEMV_SHAPES) + 1
    assert result.stdout.count("ok") == expected, result.stdout


@pytest.mark.parametrize(
    ("architecture", "extra"),
    [("Qwen3MoeForCausalLM", _MOE), ("Qwen3ForCausalLM", {}), ("LlamaForCausalLM", {})],
)
def test_no_model_opts_in_by_default(architecture: str, extra) -> None:
    """Every model's numerics stay cuBLAS's unless a layer opts in: the skinny GEMV measured
    slower than cuBLAS at batch 1 on the H200 (2026-12-02c run 5), so no model does."""
    config = ModelConfig.from_dict({**_TINY, **extra, "architectures": [architecture]})
    with torch.device("meta"):
        model = build_model(config)
    opted = [name for name, m in model.named_modules()
             if isinstance(m, LinearBase) and m.is_skinny_gemv]  # fmt: skip
    assert opted == []


@pytest.mark.parametrize(
    ("architecture", "extra"),
    [("Qwen3MoeForCausalLM", _MOE), ("Qwen3ForCausalLM", {}), ("LlamaForCausalLM", {})],
)
def test_only_qwen3_moes_attention_projections_opt_in_to_the_pdl_gemv(architecture, extra):
    """They run it only while ``triton_gemv.USE_PDL_AT_BATCH_1`` is set (the default)."""
    config = ModelConfig.from_dict({**_TINY, **extra, "architectures": [architecture]})
    with torch.device("meta"):
        model = build_model(config)
    opted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if isinstance(m, LinearBase) and m.is_pdl_gemv}  # fmt: skip
    assert opted == ({"qkv_proj", "o_proj"} if architecture == "Qwen3MoeForCausalLM" else set())
    count = sum(isinstance(m, LinearBase) and m.is_pdl_gemv for m in model.modules())
    assert count == (2 * config.num_hidden_layers if opted else 0)


def test_every_batch_1_pdl_knob_is_on_by_default() -> None:
    pytest.importorskip("triton")
    from dormant.layers import triton_gemv, triton_kv_cache, triton_norm, triton_rotary

    knobs = (triton_gemv, triton_kv_cache, triton_norm, triton_rotary)
    assert all(module.USE_PDL_AT_BATCH_1 for module in knobs)


def test_moe_benchmarks_knobs_off_child_turns_every_knob_off(monkeypatch) -> None:
    pytest.importorskip("triton")
    from benchmarks import moe
    from dormant.layers import triton_gemv, triton_kv_cache, triton_norm, triton_rotary

    knobs = (triton_gemv, triton_kv_cache, triton_norm, triton_rotary)
    for module in knobs:  # restored when the test ends
        monkeypatch.setattr(module, "USE_PDL_AT_BATCH_1", True)
    moe.knobs_off()
    assert not any(module.USE_PDL_AT_BATCH_1 for module in knobs)
