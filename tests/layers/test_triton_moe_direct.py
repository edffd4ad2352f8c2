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
        for path in ("direct", "direct-loop", "direct-tile"):
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


def test_tile_all_launches_its_gate_up_with_its_own_default_tiles(monkeypatch) -> None:
    """``kernels="tile-all"`` without ``configs`` takes ``gemv_config``'s tiles for "tile-all"
    (gate/up one row a program at 2 warps, down one column), not the loop kernel's 16 rows: a
    regression test for a call that left ``kernels`` out of the gate/up default, so the
    whole-depth tile held 16 rows (slower, the same sums)."""
    pytest.importorskip("triton")
    import torch

    from dormant.layers import triton_moe_direct as direct

    launches: dict[str, tuple[tuple[int, ...], dict]] = {}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.__setitem__(self.name, (grid, kwargs))

    for name in ("_gate_up_tile_kernel", "_down_tile_kernel"):
        monkeypatch.setattr(direct, name, Recorder(name))
    x, w13, w2 = torch.randn(1, 64), torch.randn(4, 2 * 48, 64), torch.randn(4, 64, 48)
    weights, ids = torch.ones(1, 2) / 2, torch.tensor([[0, 3]], dtype=torch.int32)
    direct.fused_experts_direct(x, w13, w2, weights, ids, kernels="tile-all")
    grid, kwargs = launches["_gate_up_tile_kernel"]
    assert grid == (2, 48) and kwargs["BLOCK_N"] == 1 and kwargs["num_warps"] == 2
    assert launches["_down_tile_kernel"][1]["BLOCK_N"] == 1
