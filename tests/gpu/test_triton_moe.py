"""The fused Triton MoE kernels against the torch reference: routing (top-k softmax), the
pairs sorted and padded by expert, and the experts by both paths (sorted: gate/up + SiLU·mul,
down, combine; direct: gate/up + SiLU·mul, down + combine), over decode and prefill sizes,
fp32/bf16/fp16, with experts nobody picks; the direct path bit-exact against the sorted one on
exact inputs; and the whole path inside a CUDA graph replayed on new routing.

tests/layers/test_triton_moe_direct.py runs the direct path's checks on the CPU through
Triton's interpreter (this folder's tests skip without CUDA, interpreted or not).
"""

from __future__ import annotations

import os

import pytest
import torch

from dormant.layers.moe_reference import select_experts

triton = pytest.importorskip("triton")
from dormant.layers.triton_moe import fused_experts  # noqa: E402
from dormant.layers.triton_moe_routing import align_by_expert, topk_softmax  # noqa: E402
from tests.layers import moe_kernel_checks as checks  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = [] if INTERPRETED else [pytest.mark.gpu]
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
# (tokens, experts, top_k, hidden, intermediate): decode sizes, prefill sizes, odd sizes
SHAPES = [(1, 8, 2, 64, 32), (7, 16, 4, 96, 40), (64, 8, 2, 64, 32), (300, 4, 3, 48, 80)]
if not INTERPRETED:
    SHAPES += [(1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (1000, 64, 6, 512, 256)]

PATH_CASES = [(path, shape) for path in ("auto", "sorted") for shape in SHAPES] + [
    ("direct", shape) for shape in SHAPES + checks.DIRECT_SHAPES
]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    return checks.random_inputs(shape, dtype, DEVICE, seed)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_topk_softmax_matches_select_experts(shape, renormalize: bool) -> None:
    *_, logits = _inputs(shape, torch.float32)
    weights, ids = topk_softmax(logits, shape[2], renormalize)
    ref_weights, ref_ids = select_experts(logits, shape[2], renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_topk_softmax_keeps_ids_in_range_on_nan_rows() -> None:
    logits = torch.randn(4, 8, device=DEVICE)
    logits[1] = float("nan")
    logits[2, 3] = float("nan")
    _, ids = topk_softmax(logits, 3, True)
    assert bool(((ids >= 0) & (ids < 8)).all())
    assert all(len(set(row.tolist())) == 3 for row in ids.cpu())  # distinct experts per token


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_align_sorts_every_pair_once_into_its_experts_blocks(shape, block_m: int) -> None:
    _, num_experts, top_k, *_ = shape
    *_, logits = _inputs(shape, torch.float32)
    _, ids = select_experts(logits, top_k, False)
    sorted_pairs, block_experts, num_padded = align_by_expert(ids, num_experts, block_m)
    num_pairs = ids.numel()
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(num_padded) == int(padded.sum()) <= sorted_pairs.numel()
    rows = sorted_pairs[: int(num_padded)].cpu().long()
    real = rows[rows < num_pairs]
    assert torch.equal(real.sort().values, torch.arange(num_pairs))  # each pair exactly once
    assert int((rows == num_pairs).sum()) == int((padded - counts).sum())  # the rest padding
    flat_ids = ids.flatten().cpu().long()
    row_experts = block_experts.cpu().long().repeat_interleave(block_m)[: int(num_padded)]
    is_pair = rows < num_pairs
    assert torch.equal(flat_ids[rows[is_pair]], row_experts[is_pair])  # rows in their expert
    assert bool((block_experts.cpu()[int(num_padded) // block_m :] >= num_experts).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("path", "shape"), PATH_CASES)
def test_fused_experts_match_the_reference(path: str, shape, dtype: torch.dtype) -> None:
    checks.check_path_matches_reference(path, shape, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", checks.DIRECT_SHAPES)
def test_the_direct_path_is_bit_exact_against_the_sorted_one(shape, dtype) -> None:
    checks.check_direct_is_bit_exact(shape, dtype, DEVICE)


def test_fused_experts_takes_the_direct_path_for_few_pairs() -> None:
    checks.check_fused_experts_dispatch(DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(  # direct at batch 1 and at its largest; sorted
    "shape", [(1, 128, 8, 2048, 768), (8, 32, 4, 256, 128), (9, 32, 4, 256, 128)]
)
def test_the_routing_and_experts_replay_in_a_cuda_graph(shape) -> None:
    """No host sync anywhere: captured once, replayed on new inputs, equal to eager."""
    x, w13, w2, logits = _inputs(shape, torch.bfloat16)
    static_x, static_logits = x.clone(), logits.clone()

    def run() -> torch.Tensor:
        weights, ids = topk_softmax(static_logits, shape[2], True)
        return fused_experts(static_x, w13, w2, weights, ids)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (1, 2):
        new_x, _, _, new_logits = _inputs(shape, torch.bfloat16, seed=seed)
        static_x.copy_(new_x)
        static_logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())
