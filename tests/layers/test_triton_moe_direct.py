"""The direct MoE path (``triton_moe_direct.py``) on the CPU, through Triton's interpreter: in a
subprocess, since ``TRITON_INTERPRET`` is read when triton is imported. The same checks run on
the GPU in tests/gpu/test_triton_moe.py, bf16 included.

fp32 and fp16 only: the interpreter casts float32 to bf16 by truncating (1 + 3/512 becomes
1.0, not 1.0078125), so a bf16 result cannot show the rounding points it is checked for.
"""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

SCRIPT = """
import torch
from tests.layers import moe_kernel_checks as checks
for shape in checks.DIRECT_SHAPES:
    for dtype in (torch.float32, torch.float16):
        for path in ("direct", "direct-loop"):
            checks.check_path_matches_reference(path, shape, dtype, "cpu")
    checks.check_direct_is_bit_exact(shape, torch.float16, "cpu")
    print("ok", shape)
checks.check_fused_experts_dispatch("cpu")
print("ok dispatch")
checks.check_direct_kernels_refuse_unknown_names("cpu")
print("ok kernels")
"""


def test_the_direct_path_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    from tests.layers.moe_kernel_checks import DIRECT_SHAPES

    assert result.stdout.count("ok") == len(DIRECT_SHAPES) + 2, result.stdout
