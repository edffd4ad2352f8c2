"""Checks of the fused Triton MoE paths, shared by the GPU tests (tests/gpu/test_triton_moe.py)
and the CPU ones through Triton's interpreter (tests/layers/test_triton_moe_direct.py).

Two kinds of inputs:
- random: each path against ``fused_experts_reference``, within the tolerances of its sums;
- exact: 0/1 activations and sparse -1/0/1 weights, so every GEMM sum is exact in float32
  (gate in 0..3, up in -2..2, then ``|h @ w2.T| < 2^9`` over at most 80 columns of h whose
  finest step is 2^-11) and the tile order cannot change a bit: two paths with the same
  rounding points (dtype after gate, up, SiLU, h, the down GEMM and the weighting; one float32
  sum over the slots in order) must agree bit for bit.
"""

from __future__ import annotations

from functools import partial

import torch

from dormant.layers.moe_reference import fused_experts_reference, select_experts
from dormant.layers.triton_moe import fused_experts, fused_experts_sorted
from dormant.layers.triton_moe_direct import (
    DIRECT_MAX_PAIRS,
    GemvConfig,
    fused_experts_direct,
    is_direct,
)

PATHS = {
    "auto": fused_experts,
    "sorted": fused_experts_sorted,
    "direct": fused_experts_direct,  # KERNELS, "tile-all"
    "direct-loop": partial(fused_experts_direct, kernels="loop"),
    "direct-tile": partial(fused_experts_direct, kernels="tile"),  # the fifteenth session's
}
# (tokens, experts, top_k, hidden, intermediate): decode sizes, top_k 1/2/8, odd sizes
# (small for the interpreter, which runs about 50 programs a second)
DIRECT_SHAPES = [(1, 4, 1, 48, 24), (3, 8, 2, 40, 36), (2, 16, 8, 64, 40), (8, 12, 2, 33, 17),
                 (5, 6, 1, 40, 80)]  # fmt: skip
ODD_TILES = (GemvConfig(8, 16, num_warps=2), GemvConfig(16, 32, num_warps=1, num_stages=2))
# the direct path's kernels: (kernels, gate/up + down tiles), odd tiles too (partial blocks of
# I and H, many steps with a masked tail, one column a program)
DIRECT_VARIANTS = [
    ("loop", None),
    ("loop", ODD_TILES),
    ("tile", None),
    ("tile", (GemvConfig(8, 16), GemvConfig(1, 16, num_warps=2))),
    ("tile-all", None),
    ("tile-all", (GemvConfig(16, 16, num_warps=2), GemvConfig(4, 16))),
]


def random_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0):
    """Drawn on ``device`` (fast for the model-sized shapes on the GPU)."""
    num_tokens, num_experts, _, hidden, inter = shape
    generator = torch.Generator(device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device)

    x = randn(num_tokens, hidden)
    w13 = randn(num_experts, 2 * inter, hidden) / hidden**0.5
    w2 = randn(num_experts, hidden, inter) / inter**0.5
    logits = randn(num_tokens, num_experts)
    logits[:, num_experts // 2] = -1e4  # one expert nobody picks
    return [t.to(dtype) for t in (x, w13, w2, logits)]


def _sparse_rows(rows: int, cols: int, per_row: int, signs: bool, generator) -> torch.Tensor:
    out = torch.zeros(rows, cols)
    picks = torch.rand(rows, cols, generator=generator).argsort(dim=1)[:, :per_row]
    values = torch.ones(rows, per_row)
    if signs:
        values = torch.randint(0, 2, (rows, per_row), generator=generator) * 2.0 - 1.0
    return out.scatter_(1, picks, values)


def exact_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0):
    """The module docstring's exact inputs (intermediate size at most 80)."""
    num_tokens, num_experts, _, hidden, inter = shape
    assert inter <= 80, "the down sums stay exact only for I <= 80"
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 2, (num_tokens, hidden), generator=generator).float()
    gate = _sparse_rows(num_experts * inter, hidden, 3, False, generator)
    up = _sparse_rows(num_experts * inter, hidden, 2, True, generator)
    w13 = torch.cat([gate.view(num_experts, inter, hidden), up.view(num_experts, inter, hidden)], 1)
    w2 = torch.randint(-1, 2, (num_experts, hidden, inter), generator=generator).float()
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    return [t.to(device, dtype) for t in (x, w13, w2, logits)]


def assert_close_to_reference(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)
        return
    # the same rounding points; the kernels sum k in another order than the reference GEMM
    scale = float(reference.float().abs().max())
    torch.testing.assert_close(ours.float(), reference.float(), rtol=0, atol=0.02 * scale)
    assert float((ours.float() - reference.float()).abs().mean()) < 2e-3 * scale


def check_path_matches_reference(path: str, shape, dtype: torch.dtype, device: str) -> None:
    x, w13, w2, logits = random_inputs(shape, dtype, device)
    weights, ids = select_experts(logits, shape[2], renormalize=True)
    ours = PATHS[path](x, w13, w2, weights, ids)
    assert_close_to_reference(ours, fused_experts_reference(x, w13, w2, weights, ids))


def check_direct_is_bit_exact(shape, dtype: torch.dtype, device: str) -> None:
    """On exact inputs: the direct path equals the sorted one bit for bit, by each of its
    kernels (``DIRECT_VARIANTS``), at default tiles and at odd ones."""
    x, w13, w2, logits = exact_inputs(shape, dtype, device)
    weights, ids = select_experts(logits, shape[2], renormalize=False)
    sorted_out = fused_experts_sorted(x, w13, w2, weights, ids)
    assert bool(sorted_out.ne(0).any()), "inputs too sparse: the check would prove nothing"
    for kernels, configs in DIRECT_VARIANTS:
        direct = fused_experts_direct(x, w13, w2, weights, ids, configs, kernels=kernels)
        assert torch.equal(direct, sorted_out), (kernels, configs)


def check_fused_experts_dispatch(device: str) -> None:
    """``fused_experts`` is the direct path up to ``DIRECT_MAX_PAIRS`` pairs, then sorted."""
    assert DIRECT_MAX_PAIRS == 32 and is_direct(4, 8) and not is_direct(5, 8)
    for shape in ((4, 16, 8, 16, 16), (5, 16, 8, 16, 16), (32, 4, 1, 16, 16), (33, 4, 1, 16, 16)):
        x, w13, w2, logits = random_inputs(shape, torch.float32, device)
        weights, ids = select_experts(logits, shape[2], renormalize=True)
        is_few = is_direct(shape[0], shape[2])
        expected = (fused_experts_direct if is_few else fused_experts_sorted)(
            x, w13, w2, weights, ids
        )
        assert torch.equal(fused_experts(x, w13, w2, weights, ids), expected), shape


def check_direct_kernels_refuse_unknown_names(device: str) -> None:
    """A misspelled ``kernels`` raises, naming the choices."""
    x, w13, w2, logits = random_inputs((1, 4, 2, 16, 16), torch.float32, device)
    weights, ids = select_experts(logits, 2, renormalize=True)
    try:
        fused_experts_direct(x, w13, w2, weights, ids, kernels="tiled")
    except ValueError as error:
        assert "loop" in str(error) and "tile" in str(error), error
    else:
        raise AssertionError("kernels='tiled' was accepted")
