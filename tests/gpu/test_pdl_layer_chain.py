"""The batch-1 decoder layer under programmatic dependent launch on the GPU (``triton_pdl.py``):
every kernel of the layer that can launch with PDL does, in one CUDA graph over several
chained layers, and every replay on fresh inputs must give the bits of the same kernels
launched plainly and eagerly (a kernel reading its input before the previous one wrote it, or
an L1 line of an earlier layer's buffer, would show). The chains are
``benchmarks/moe_b1_chains.py``'s, at Qwen3-30B-A3B's shapes in bf16.

Also the PDL GEMV (``pdl_linear``) against ``F.linear`` at the model's QKV and O shapes, and an
opted-in layer taking it only at one token while ``USE_PDL_AT_BATCH_1`` is set.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
triton = pytest.importorskip("triton")

from benchmarks.moe_b1_chains import (  # noqa: E402
    AttentionChain,
    Chain,
    LayerChain,
    Variant,
    _layer_variants,
)
from benchmarks.moe_b1_sweep import capture  # noqa: E402
from dormant.layers import triton_gemv  # noqa: E402
from dormant.layers.triton_pdl import is_pdl_available  # noqa: E402
from tests.layers import moe_gemv_checks as gemv_checks  # noqa: E402

NUM_LAYERS, NUM_REPLAYS = 4, 5


@pytest.fixture(autouse=True)
def _needs_pdl() -> None:
    if not is_pdl_available(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0")


def _check_replays_match(chain: Chain, variant: Variant, reference: Variant) -> None:
    graph, outputs = capture(lambda: chain.run(variant))
    for seed in range(1, NUM_REPLAYS + 1):
        chain.refill(seed)
        graph.replay()
        torch.cuda.synchronize()
        for index, (ours, plain) in enumerate(zip(outputs, chain.run(reference), strict=True)):
            assert torch.equal(ours, plain), (variant.name, seed, index)


@pytest.fixture(scope="module")
def layer_chain() -> LayerChain:
    return LayerChain(NUM_LAYERS)


@pytest.mark.parametrize("name", [variant.name for variant in _layer_variants()])
def test_the_layer_chain_replays_the_bits_of_plain_launches(layer_chain: LayerChain, name: str):
    """Every variant of the layer sweep (``_layer_variants``: cuBLAS projections without the
    norm, rotary and KV-write PDL; the engine's defaults; the fifteenth session's GEMV tiles and
    experts; the GEMV's whole depth before the wait; "tile-all"'s tiles around its default):
    4 chained layers in one graph, replayed on fresh inputs, equal to their kernels launched
    plainly, eagerly; tickets back at 0."""
    (variant,) = [v for v in layer_chain.variants if v.name == name]
    _check_replays_match(layer_chain, variant, layer_chain.reference(variant))
    assert all(int(ticket) == 0 for ticket in layer_chain.tickets)
    assert all(int(t.count_nonzero()) == 0 for t in layer_chain.merge_tickets)


def test_the_batch_1_attention_with_pdl_replays_the_bits_of_plain_launches() -> None:
    """The KV write and the decode attention (PDL by default at batch 1, the splits merged by
    tickets) of 96 layers."""
    chain = AttentionChain()
    _check_replays_match(chain, chain.default, Variant("plain", (("pdl", False),)))
    assert all(int(t.count_nonzero()) == 0 for t in chain.merge_tickets)


@pytest.mark.parametrize("shape", [(1, 5120, 2048), (1, 2048, 4096)])
def test_the_pdl_gemv_is_f_linear_at_the_models_projections(shape) -> None:
    gemv_checks.check_pdl_gemv(shape, torch.bfloat16, "cuda")


def test_an_opted_in_layer_runs_the_pdl_gemv_at_one_token_while_the_knob_is_set(monkeypatch):
    from dormant.layers.linear import ReplicatedLinear

    with torch.device("cuda"):
        layer = ReplicatedLinear(2048, 5120, bias=False, dtype=torch.bfloat16)
    layer.weight.data.normal_(0.0, 0.02)
    layer.enable_pdl_gemv()
    for num_tokens in (1, 2):
        x = torch.randn(num_tokens, 2048, device="cuda").bfloat16()
        cublas = torch.nn.functional.linear(x, layer.weight)
        monkeypatch.setattr(triton_gemv, "USE_PDL_AT_BATCH_1", False)
        assert torch.equal(layer(x), cublas)
        monkeypatch.setattr(triton_gemv, "USE_PDL_AT_BATCH_1", True)
        expected = triton_gemv.pdl_linear(x, layer.weight) if num_tokens == 1 else cublas
        assert torch.equal(layer(x), expected), num_tokens
