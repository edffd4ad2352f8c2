"""Programmatic dependent launch above batch 1 on the GPU (``USE_PDL_ABOVE_BATCH_1``,
``triton_pdl.py``): the dense decode layer at rollout batch sizes, every Triton kernel of it
launched with PDL, in one CUDA graph over chained layers, replayed on fresh inputs, must give
the bits of the same kernels launched plainly and eagerly (``benchmarks/dense_decode_sweep.py``'s
chain at Qwen3-8B's shapes); and an engine with every such knob on generates the tokens and
logprobs of one with them off, through its graphs, at a batch of sequences.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from benchmarks.dense_decode_sweep import DenseLayerChain  # noqa: E402
from benchmarks.moe_b1_chains import Variant  # noqa: E402
from benchmarks.moe_b1_sweep import capture  # noqa: E402
from dormant import SamplingParams  # noqa: E402
from dormant.layers import (  # noqa: E402
    triton_activation,
    triton_attention,
    triton_kv_cache,
    triton_norm,
    triton_rotary,
)
from dormant.layers.triton_pdl import is_pdl_available  # noqa: E402
from tests.engine.conftest import write_checkpoint  # noqa: E402
from tests.gpu.conftest import make_engine  # noqa: E402

KNOB_MODULES = (triton_activation, triton_attention, triton_kv_cache, triton_norm, triton_rotary)
NUM_LAYERS, NUM_REPLAYS = 4, 3


@pytest.fixture(autouse=True)
def _needs_pdl() -> None:
    if not is_pdl_available(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0")


@pytest.mark.parametrize("batch", [64, 128])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_the_dense_layer_with_pdl_replays_the_bits_of_plain_launches(batch, splits) -> None:
    chain = DenseLayerChain(batch, context=768, num_layers=NUM_LAYERS)
    options: tuple[tuple[str, object], ...] = (("pdl", True),)
    if splits is not None:
        options += (("wanted_splits", splits),)
    variant = Variant("pdl", options)
    graph, outputs = capture(lambda: chain.run(variant))
    for seed in range(1, NUM_REPLAYS + 1):
        chain.refill(seed)
        graph.replay()
        torch.cuda.synchronize()
        plain = chain.run(chain.reference(variant))
        for index, (ours, expected) in enumerate(zip(outputs, plain, strict=True)):
            assert torch.equal(ours, expected), (batch, splits, seed, index)


def test_the_knob_turns_pdl_on_above_batch_1_only(monkeypatch) -> None:
    """``pdl_for`` reads the module's knob for the launch's size at each call."""
    from dormant.layers.triton_pdl import pdl_for

    device = torch.device("cuda")
    monkeypatch.setattr(triton_norm, "USE_PDL_ABOVE_BATCH_1", True)
    monkeypatch.setattr(triton_norm, "USE_PDL_AT_BATCH_1", False)
    knobs = (triton_norm.USE_PDL_AT_BATCH_1, triton_norm.USE_PDL_ABOVE_BATCH_1)
    assert not pdl_for(1, None, *knobs, device)
    assert pdl_for(64, None, *knobs, device)
    assert not pdl_for(64, False, *knobs, device)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return write_checkpoint(tmp_path_factory.mktemp("pdl_ckpt"), seed=2)


def _rollout(engines, checkpoint) -> list[tuple[tuple[int, ...], list[float]]]:
    """Greedy, 3 prompts; then sampled, n=8 of each (24 sequences): through the engine's
    graphs, each sequence's tokens and its chosen tokens' logprobs."""
    llm = make_engine(engines, checkpoint, max_num_seqs=32, cuda_graph_multi_steps=4)
    prompts = [[5, 17, 99, 3, 250, 42], [7, 7, 7], [101, 202, 33, 44, 55, 66, 77, 88, 99, 11]]
    results = []
    for params in (
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0),
        SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True, logprobs=0),
    ):
        for output in llm.generate(prompts, params, use_tqdm=False):
            for sample in output.outputs:
                chosen = [next(iter(step.values())).logprob for step in sample.logprobs]
                results.append((tuple(sample.token_ids), chosen))
    engines.remove(llm)  # one memory manager per device: the next engine needs this one gone
    llm.shutdown()
    return results


def test_an_engine_with_pdl_above_batch_1_generates_the_bits_of_plain_launches(
    engines, checkpoint, monkeypatch
) -> None:
    plain = _rollout(engines, checkpoint)
    for module in KNOB_MODULES:
        monkeypatch.setattr(module, "USE_PDL_ABOVE_BATCH_1", True)
    assert _rollout(engines, checkpoint) == plain
