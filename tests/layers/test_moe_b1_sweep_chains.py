"""``benchmarks/moe_b1_sweep.py``'s chains on the CPU, through Triton's interpreter, at small
shapes in float32: every variant the GPU sweep times launches (its options are the kernels'
real keywords) and its outputs pass the sweep's own check against its reference (the default;
in the layer group, its own kernels launched plainly), and a wrong output fails that check.
Of variants that set the same options to other values (tile configs, split counts), the first
runs here: the others launch the same kernels with other constants, which the GPU tests check
at every config (tests/gpu/test_triton_moe.py), and the GPU sweep checks each variant it times
against its reference itself (every variant here took 3 minutes of CI). The timing and the
graphs are the GPU's (not run here)."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

SCRIPT = """
import torch
import benchmarks.moe_b1_chains as chains
from benchmarks.moe_b1_sweep import compare

chains.DEVICE, chains.DTYPE = torch.device("cpu"), torch.float32
chains.HIDDEN, chains.NUM_EXPERTS, chains.TOP_K, chains.INTER = 64, 8, 2, 48
chains.NUM_HEADS, chains.NUM_KV_HEADS, chains.HEAD_DIM = 4, 2, 16
chains.CONTEXT, chains.MAX_MODEL_LEN, chains.MOE_LAYERS, chains.ATTENTION_LAYERS = 40, 128, 1, 1
chains.LAYER_LAYERS = 2  # chained: the second layer's input is the first one's output
for group in ("moe", "attention", "layer"):
    chain = chains.GROUPS[group]()
    expected = chain.run(chain.default)
    assert len({v.name for v in chain.variants}) == len(chain.variants), "names repeat"
    kinds = set()
    for variant in chain.variants:
        kind = tuple(key for key, _ in variant.options)
        if kind in kinds:
            continue  # the same options as a variant run already, at other values
        kinds.add(kind)
        reference = chain.reference(variant)
        reference_out = expected if reference == chain.default else chain.run(reference)
        ours = expected if variant == chain.default else chain.run(variant)
        checked = compare(ours, reference_out)
        assert checked["is_ok"], (variant.name, checked)
    wrong = [t + 1 if t.is_floating_point() else t for t in expected]
    assert not compare(wrong, expected)["is_ok"]
    chain.refill(seed=5)
    assert not compare(chain.run(chain.default), expected)["is_ok"], "refill changed nothing"
    print("ok", group, len(chain.variants))
"""


def test_every_sweep_variant_runs_and_checks_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok") == 3, result.stdout
