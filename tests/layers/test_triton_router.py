"""The fused MoE router (``triton_router.py``) on the CPU, through Triton's interpreter: in a
subprocess, since ``TRITON_INTERPRET`` is read when triton is imported. The interpreter runs the
programs one after another, so the ticket's last program is the grid's last; on the GPU they
race, and tests/gpu/test_triton_moe.py runs the same checks there, bf16 and CUDA graphs
included.

fp32 and fp16 only: the interpreter casts float32 to bf16 by truncating, so a bf16 logit would
not be the GEMM's rounded one.
"""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

SCRIPT = """
import torch
from tests.layers import moe_router_checks as checks
for shape in checks.ROUTER_SHAPES:
    for renormalize in (True, False):
        checks.check_exact_routing(shape, torch.float16, renormalize, "cpu")
        checks.check_random_routing(shape, torch.float32, renormalize, "cpu")
    checks.check_random_routing(shape, torch.float16, True, "cpu")
    print("ok", shape)
checks.check_nan_rows_route_to_real_experts("cpu")
checks.check_bad_inputs_raise("cpu")
print("ok errors")
"""


# The MoE model's forward with its Triton paths forced on CPU tensors (the router, the experts,
# the attention projections' GEMV; the rest stays torch): a prefill of 3 tokens and decodes of
# 1 take router_topk, 6 tokens the unfused router; each call counted.
MODEL_SCRIPT = """
import sys
import torch
sys.path.insert(0, "tests/models")
from tiny_models import PagedRunner, materialize, qwen3_moe_mixed_config
import dormant.layers.linear as linear
import dormant.layers.moe as moe
import dormant.models.qwen3_moe as qwen3_moe
from dormant.models import ModelConfig, build_model

hf = qwen3_moe_mixed_config().to_dict()
hf.update(architectures=["Qwen3MoeForCausalLM"], dtype="float32")
with torch.device("meta"):
    model = build_model(ModelConfig.from_dict(hf))
materialize(model, torch.device("cpu"))
model.init_buffers()
model.reset_kv_scales()
model.init_random_weights(seed=3)
prompts = [[[5, 9, 2]], [[7]], [[11]], [[1, 2, 3, 4, 5, 6]]]
reference = PagedRunner(model, 1, 32, 4)
expected = [reference.step(p)[0] for p in prompts]
calls = {"router_topk": 0, "skinny_linear": 0}

def counted(name, module):
    original = getattr(module, name)
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)
    setattr(module, name, wrapper)

counted("router_topk", qwen3_moe)
counted("skinny_linear", linear)
for module in (linear, moe, qwen3_moe):
    module.use_triton = lambda x: True
for layer in model.model.layers:  # the skinny GEMV is opt-in per layer
    layer.self_attn.qkv_proj.enable_skinny_gemv()
    layer.self_attn.o_proj.enable_skinny_gemv()
ours = PagedRunner(model, 1, 32, 4)
for prompt, logits in zip(prompts, expected):
    torch.testing.assert_close(ours.step(prompt)[0], logits, rtol=1e-4, atol=1e-4)
num_sparse = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
assert 0 < num_sparse < len(model.model.layers)
assert calls["router_topk"] == 3 * num_sparse, calls
assert calls["skinny_linear"] == 3 * 2 * len(model.model.layers), calls
assert all(int(m.router_ticket) == 0 for m in model.modules() if hasattr(m, "router_ticket"))
print("ok model")
"""


def test_the_moe_model_decodes_through_its_triton_paths_in_the_interpreter() -> None:
    """The sparse layers' dispatch (router_topk up to 4 tokens, then the GEMM + topk_softmax)
    and the opted-in projections, end to end: the logits equal the torch path's."""
    pytest.importorskip("triton")
    result = run_interpreted(MODEL_SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok model" in result.stdout, result.stdout


def test_the_fused_router_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    from tests.layers.moe_router_checks import ROUTER_SHAPES

    assert result.stdout.count("ok") == len(ROUTER_SHAPES) + 1, result.stdout
