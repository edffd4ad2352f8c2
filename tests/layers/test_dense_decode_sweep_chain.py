"""``benchmarks/dense_decode_sweep.py``'s chain on the CPU, through Triton's interpreter, at small
shapes in float32: every variant the GPU sweep times launches (its options are the kernels' real
keywords), each equals its own kernels launched plainly, and every split count agrees with the
default within the sweep's check (a wrong output fails it). PDL, the graphs and the timing are
the GPU's (tests/gpu/test_pdl_above_batch_1.py)."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

SCRIPT = """
import torch
import benchmarks.dense_decode_sweep as sweep
from benchmarks.moe_b1_sweep import compare

sweep.DTYPE = torch.float32
sweep.HIDDEN, sweep.INTER, sweep.NUM_HEADS, sweep.NUM_KV_HEADS, sweep.HEAD_DIM = 64, 96, 4, 2, 16
sweep.MAX_MODEL_LEN = 256
chain = sweep.DenseLayerChain(3, context=150, num_layers=2, device=torch.device("cpu"))
expected = chain.run(chain.default)
assert len({v.name for v in chain.variants}) == len(chain.variants), "names repeat"
for variant in chain.variants:
    ours = chain.run(variant)
    plain = chain.run(chain.reference(variant))
    assert all(torch.equal(a, b) for a, b in zip(ours, plain, strict=True)), variant.name
    checked = compare(ours, expected)
    assert checked["is_ok"], (variant.name, checked)
wrong = [t + 1 for t in expected]
assert not compare(wrong, expected)["is_ok"]
chain.refill(seed=5)
assert not compare(chain.run(chain.default), expected)["is_ok"], "refill changed nothing"
assert chain.roofline_s(1e12) > 0
print("ok", len(chain.variants))
"""


def test_every_sweep_variant_runs_and_checks_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(SCRIPT, timeout_s=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok 12" in result.stdout, result.stdout
