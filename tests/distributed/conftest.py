"""One local Ray cluster for the Ray tests of this folder (started once: a Ray start costs
seconds on CI's two cores). Logical resources only: 4 CPUs and 4 GPUs that Ray hands out as
labels, so the frameworks' placement-group bundles ({"GPU": 1, "CPU": 1}) can be reserved on a
machine without GPUs; the engines themselves run on the CPU (gloo)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[Any]:
    import ray

    ray.init(
        num_cpus=4,
        num_gpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},  # tests' worker extensions
    )
    yield ray
    ray.shutdown()
