"""The rollout benchmark's decode bounds (``benchmarks/rollout.py``): the memory roofline, and the
bound with compute, where a large batch's GEMMs take their flops at the GEMM rate, not the time
to read their weights."""

from __future__ import annotations

import pytest

from benchmarks.rollout import Device, Step, roofline_rows

DEVICE = Device(bandwidth=4e12, flops=8e14)
WEIGHT_BYTES, GEMM_PARAMS, KV_PER_TOKEN = 16 * 10**9, 8 * 10**9, 147456


def row(num_seqs: int, context: int) -> dict:
    step = Step(False, num_seqs, 0, num_seqs * context, seconds=0.03)
    (only,) = roofline_rows([step], WEIGHT_BYTES, GEMM_PARAMS, KV_PER_TOKEN, DEVICE)
    return only


def test_a_small_batch_is_bound_by_memory_alone() -> None:
    result = row(8, 768)
    assert result["compute_bound_s"] == pytest.approx(result["roofline_s"])


def test_a_large_batch_s_gemms_are_bound_by_their_flops() -> None:
    result = row(512, 768)
    kv_s = 512 * 768 * KV_PER_TOKEN / DEVICE.bandwidth
    assert result["roofline_s"] == pytest.approx(WEIGHT_BYTES / DEVICE.bandwidth + kv_s)
    gemm_s = 2 * GEMM_PARAMS * 512 / DEVICE.flops  # 10.2 ms, against 4 ms to read the weights
    assert result["compute_bound_s"] == pytest.approx(gemm_s + kv_s)
    assert result["x_compute_bound"] < result["x_roofline"]
