"""TRL's GRPO end to end on dormant (issue #15): ``GRPOTrainer(use_vllm=True,
vllm_mode="colocate", vllm_enable_sleep_mode=True)`` with dormant installed as vllm. The
rollout logprobs agree with the trainer's (TRL's importance-sampling ratio is 1 within 1e-3 on
average and 1e-2 at worst), TRL's weight sync leaves the engine's weights equal to the policy's,
and the loss and gradients are finite and not all zero."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is in the test extra")
REPO = Path(__file__).resolve().parents[2]


def test_grpo_colocate_with_sleep_mode(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, str(REPO / "tests/frameworks/trl_grpo_run.py"), str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["num_steps"] == 3
    assert all(abs(mean - 1.0) <= 1e-3 for mean in report["is_ratio_mean"]), report
    assert all(low >= 1 - 1e-2 for low in report["is_ratio_min"]), report
    assert all(high <= 1 + 1e-2 for high in report["is_ratio_max"]), report
    assert report["weights_compared"] > 0 and report["max_weight_delta"] == 0.0, report
    values = report["loss"] + report["grad_norm"]
    assert all(math.isfinite(v) for v in values) and any(v != 0 for v in report["grad_norm"])
