"""The fused Triton MoE kernels against the torch reference: routing (top-k softmax), the
pairs sorted and padded by expert, and the experts by both paths (sorted: gate/up + SiLU·mul,
down, combine; direct: gate/up + SiLU·mul, down + combine), over decode and prefill sizes,
fp32/bf16/fp16, with experts nobody picks; the direct path bit-exact against the sorted one on
exact inputs; and the whole path inside a CUDA graph replayed on new routing. The fused router
(router GEMV + softmax + top-k, ``triton_router.py``) against ``F.linear`` + ``topk_softmax``,
at decode sizes up to Qwen3-30B-A3B's, in a CUDA graph, and as the sparse layer's path. The
skinny GEMV of the MoE model's attention projections (``triton_gemv.py``) against ``F.linear``.

tests/layers/test_triton_moe_direct.py runs the direct path's checks on the CPU through
Triton's interpreter (this folder's tests skip without CUDA, interpreted or not).
"""

from __future__ import annotations

import os

import pytest
import torch

from dormant.layers.moe_reference import select_experts

triton = pytest.importorskip("triton")
from benchmarks.moe_b1_sweep import capture  # noqa: E402
from dormant.layers.triton_gemv import SKINNY_MAX_TOKENS, skinny_linear  # noqa: E402
from dormant.layers.triton_moe import fused_experts  # noqa: E402
from dormant.layers.triton_moe_routing import align_by_expert, topk_softmax  # noqa: E402
from dormant.layers.triton_router import (  # noqa: E402
    FUSED_ROUTER_MAX_TOKENS,
    new_router_ticket,
    router_topk,
)
from tests.layers import moe_gemv_checks as gemv_checks  # noqa: E402
from tests.layers import moe_kernel_checks as checks  # noqa: E402
from tests.layers import moe_router_checks as router_checks  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = [] if INTERPRETED else [pytest.mark.gpu]
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
# (tokens, experts, top_k, hidden, intermediate): decode sizes, prefill sizes, odd sizes
SHAPES = [(1, 8, 2, 64, 32), (7, 16, 4, 96, 40), (64, 8, 2, 64, 32), (300, 4, 3, 48, 80)]
if not INTERPRETED:
    SHAPES += [(1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (1000, 64, 6, 512, 256)]

ROUTER_SHAPES = list(router_checks.ROUTER_SHAPES)
if not INTERPRETED:  # Qwen3-30B-A3B's router at every fused batch size
    ROUTER_SHAPES += [(t, 128, 8, 2048) for t in range(1, FUSED_ROUTER_MAX_TOKENS + 1)]

GEMV_SHAPES = list(gemv_checks.GEMV_SHAPES)
if not INTERPRETED:  # Qwen3-30B-A3B's QKV and O projections at every skinny batch size
    GEMV_SHAPES += [(t, n, k) for t in range(1, 5) for n, k in ((5120, 2048), (2048, 4096))]

PATH_CASES = [(path, shape) for path in ("auto", "sorted") for shape in SHAPES] + [
    (path, shape)
    for path in ("direct", "direct-loop", "direct-tile")
    for shape in SHAPES + checks.DIRECT_SHAPES
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

    graph, out = capture(run)
    for seed in (1, 2):
        new_x, _, _, new_logits = _inputs(shape, torch.bfloat16, seed=seed)
        static_x.copy_(new_x)
        static_logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROUTER_SHAPES)
def test_the_fused_router_is_topk_softmax_of_the_router_gemm(shape, dtype, renormalize) -> None:
    """Exact inputs: bit for bit ``topk_softmax(F.linear(x, w))``. Random ones: the logits within
    one ulp of cuBLAS's, the routing bit for bit ``topk_softmax`` on them, the ids
    ``select_experts``' (no near ties)."""
    router_checks.check_exact_routing(shape, dtype, renormalize, DEVICE)
    router_checks.check_random_routing(shape, dtype, renormalize, DEVICE)


def test_the_fused_router_routes_nan_rows_and_refuses_bad_inputs() -> None:
    router_checks.check_nan_rows_route_to_real_experts(DEVICE)
    router_checks.check_bad_inputs_raise(DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_tokens", [1, FUSED_ROUTER_MAX_TOKENS])
def test_the_fused_router_and_experts_replay_in_a_cuda_graph(num_tokens: int) -> None:
    """48 layers' routers (one ticket each) and experts in one graph, replayed 20 times on new
    inputs: every replay equals eager (a program routing before another's logits landed would
    show), and every ticket is back at zero."""
    shape = (num_tokens, 128, 8, 2048, 768)
    x, w13, w2, _ = _inputs(shape, torch.bfloat16)
    gates = [torch.randn(128, 2048, device="cuda").div(2048**0.5).bfloat16() for _ in range(48)]
    tickets = [new_router_ticket("cuda") for _ in gates]
    static_x = x.clone()

    def run() -> list[torch.Tensor]:
        outs = []
        for gate, ticket in zip(gates, tickets, strict=True):
            weights, ids, _ = router_topk(static_x, gate, 8, True, ticket)
            outs += [ids, fused_experts(static_x, w13, w2, weights, ids)]
        return outs

    graph, outs = capture(run)
    generator = torch.Generator("cuda").manual_seed(1)
    for seed in range(1, 21):
        static_x.copy_(torch.randn(x.shape, device="cuda", generator=generator).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        for ours, eager in zip(outs, run(), strict=True):
            assert torch.equal(ours, eager), seed
        assert all(int(ticket) == 0 for ticket in tickets)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="PDL and CUDA graphs need a GPU")
@pytest.mark.parametrize("kernels", ["loop", "tile", "tile-all"])
def test_the_pdl_chain_replays_the_bits_of_plain_launches(kernels: str) -> None:
    """Norm, router and experts of 12 layers launched with programmatic dependent launch in one
    graph (triton_pdl.py: each kernel starts before the one before it ends), replayed 10 times
    on new inputs: every replay equals the same kernels launched plainly, eagerly, bit for bit
    (a program reading ids, h or partials before they landed would show), tickets back at 0."""
    from dormant.layers.triton_moe_direct import fused_experts_direct
    from dormant.layers.triton_norm import rms_norm
    from dormant.layers.triton_pdl import is_pdl_available

    if not is_pdl_available(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0")
    shape = (1, 128, 8, 2048, 768)
    x, w13, w2, _ = _inputs(shape, torch.bfloat16)
    gates = [torch.randn(128, 2048, device="cuda").div(2048**0.5).bfloat16() for _ in range(12)]
    tickets = [new_router_ticket("cuda") for _ in gates]
    norm_weight = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    static_x = x.clone()

    def run(pdl: bool) -> list[torch.Tensor]:
        outs = []
        for gate, ticket in zip(gates, tickets, strict=True):
            normed, _ = rms_norm(static_x, norm_weight, 1e-6)
            weights, ids, _ = router_topk(normed, gate, 8, True, ticket, pdl=pdl)
            outs += [ids, fused_experts_direct(normed, w13, w2, weights, ids, kernels=kernels,
                                               pdl=pdl)]  # fmt: skip
        return outs

    graph, outs = capture(lambda: run(True))
    generator = torch.Generator("cuda").manual_seed(1)
    for seed in range(1, 11):
        static_x.copy_(torch.randn(x.shape, device="cuda", generator=generator).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        for ours, plain in zip(outs, run(False), strict=True):
            assert torch.equal(ours, plain), seed
        assert all(int(ticket) == 0 for ticket in tickets)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="the sparse layer takes Triton on CUDA tensors only")
def test_the_sparse_layer_routes_decode_batches_with_the_fused_router() -> None:
    """Up to FUSED_ROUTER_MAX_TOKENS tokens: the experts on ``router_topk``'s routing; more:
    the router's GEMM, then ``topk_softmax``, bit for bit."""
    from dormant.models import ModelConfig
    from dormant.models.qwen3_moe import SparseMoeBlock

    config = ModelConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512,
        "torch_dtype": "bfloat16", "num_experts": 64,
        "num_experts_per_tok": 8, "moe_intermediate_size": 128, "norm_topk_prob": True,
    })  # fmt: skip
    with torch.device("cuda"):
        block = SparseMoeBlock(config)
    for param in block.parameters():
        param.data.normal_(0.0, 0.05)
    experts = block.experts
    for num_tokens in range(1, FUSED_ROUTER_MAX_TOKENS + 2):
        x = torch.randn(num_tokens, 256, device="cuda").bfloat16()
        if num_tokens <= FUSED_ROUTER_MAX_TOKENS:
            weights, ids, _ = router_topk(x, block.gate.weight, 8, True, new_router_ticket("cuda"))
            expected = experts.forward_routed(x, weights, ids)
        else:
            expected = experts(x, block.gate(x))
        assert torch.equal(block(x), expected), num_tokens
        assert int(block.router_ticket) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GEMV_SHAPES)
def test_the_skinny_gemv_is_f_linear(shape, dtype: torch.dtype) -> None:
    """Exact inputs: bit for bit ``F.linear``; random ones: within one ulp of the dtype."""
    gemv_checks.check_exact(shape, dtype, DEVICE)
    gemv_checks.check_random(shape, dtype, DEVICE)


def test_the_skinny_gemv_refuses_bad_inputs() -> None:
    gemv_checks.check_bad_inputs_raise(DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
def test_the_skinny_gemv_replays_in_a_cuda_graph() -> None:
    x = torch.randn(SKINNY_MAX_TOKENS, 2048, device="cuda").bfloat16()
    w = torch.randn(5120, 2048, device="cuda").div(2048**0.5).bfloat16()
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_linear(static_x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(static_x, w)
    for _ in range(3):
        static_x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, skinny_linear(static_x, w))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="layers take Triton on CUDA tensors only")
def test_an_opted_in_layer_runs_the_skinny_gemv_at_decode_sizes_only() -> None:
    from dormant.layers.linear import ReplicatedLinear

    with torch.device("cuda"):
        layer = ReplicatedLinear(2048, 5120, bias=True, dtype=torch.bfloat16)
    layer.weight.data.normal_(0.0, 0.02)
    layer.bias.data.normal_(0.0, 0.02)
    for num_tokens in range(1, SKINNY_MAX_TOKENS + 2):
        x = torch.randn(num_tokens, 2048, device="cuda").bfloat16()
        cublas = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.equal(layer(x), cublas)  # not opted in: cuBLAS
        layer.enable_skinny_gemv()
        is_skinny = num_tokens <= SKINNY_MAX_TOKENS
        expected = skinny_linear(x, layer.weight, layer.bias) if is_skinny else cublas
        assert torch.equal(layer(x), expected), num_tokens
        layer.is_skinny_gemv = False
