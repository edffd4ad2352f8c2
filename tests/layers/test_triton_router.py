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


def test_the_fused_router_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    from tests.layers.moe_router_checks import ROUTER_SHAPES

    assert result.stdout.count("ok") == len(ROUTER_SHAPES) + 1, result.stdout
