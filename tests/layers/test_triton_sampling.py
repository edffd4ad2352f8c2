"""The fused sampler draw (``triton_sampling.py``) gives the torch reference's tokens, row for
row: on the CPU through Triton's interpreter (in a subprocess, since ``TRITON_INTERPRET`` is
read when triton is imported), and on the GPU at the rollout's vocabulary and batch sizes."""

from __future__ import annotations

import pytest

from tests.layers import sampling_checks as checks
from tests.triton_interpreter import run_interpreted

SCRIPT = """
from tests.layers import sampling_checks as checks
checks.check_the_constants_are_the_samplers()
for shape in checks.SHAPES:
    checks.check_race_matches_the_reference(shape, "cpu")
    print("ok", shape)
"""


def test_the_fused_draw_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok") == len(checks.SHAPES), result.stdout


def test_the_kernel_compiles_for_hopper() -> None:
    """The compiler's own checks (types of loop-carried values, integer promotion) and the
    rounding it emits, without a GPU: IEEE division, no approximate one."""
    pytest.importorskip("triton")
    ptx = checks.hopper_ptx()
    assert "div.rn.f32" in ptx
    assert "div.full.f32" not in ptx and "div.approx.f32" not in ptx


def test_one_compiled_kernel_for_every_batch_size() -> None:
    """The eager path's sampling rows sit at offsets of one packed buffer that move with the
    batch size, as does ``stride_keys``: a specialisation on them recompiled the kernel (about
    0.4 s) at the first step of each new batch shape, mid-rollout (H200 run of 2026-12-02)."""
    pytest.importorskip("triton")
    first = checks.launch_specialisations(1, 151936)
    for num_rows in (2, 33, 128, 512):
        assert checks.launch_specialisations(num_rows, 151936) == first, num_rows


@pytest.mark.gpu
@pytest.mark.parametrize("shape", checks.SHAPES + checks.GPU_SHAPES)
def test_the_fused_draw_on_the_gpu(shape: tuple[int, int]) -> None:
    pytest.importorskip("triton")
    checks.check_the_constants_are_the_samplers()
    checks.check_race_matches_the_reference(shape, "cuda")
