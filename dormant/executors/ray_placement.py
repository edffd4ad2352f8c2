"""Where the Ray workers run: bundles of a placement group, chosen the way vLLM chooses them.

    placement group                              bundles (rank r runs on bundle b[r])
    ───────────────────────────────────────────  ─────────────────────────────────────────────
    LLM(..., placement_group=pg)                 ``VLLM_RAY_BUNDLE_INDICES`` ("2,3") if set,
    else the current one (this code runs in an   else the first ``tensor_parallel_size``
      actor scheduled on a placement group with    bundles that hold the device resource
      ``placement_group_capture_child_tasks``)     ("GPU" on GPUs, "CPU" on CPUs)
    else one dormant creates: ``tensor_parallel_  all of them; dormant removes the group at
      size`` bundles of {"GPU" or "CPU": 1},      shutdown
      PACK

OpenRLHF and NeMo-RL use the second row: their engine runs in an actor on their placement
group, with ``VLLM_RAY_BUNDLE_INDICES`` naming its bundles and ``VLLM_RAY_PER_WORKER_GPUS`` the
GPU share of each worker (vLLM's names, read here with vLLM's meaning).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dormant.core.errors import UnsupportedOptionError

PLACEMENT_TIMEOUT_S = 1800.0  # vLLM's PG_WAIT_TIMEOUT
BUNDLE_INDICES_VARIABLE = "VLLM_RAY_BUNDLE_INDICES"
PER_WORKER_GPUS_VARIABLE = "VLLM_RAY_PER_WORKER_GPUS"


@dataclass(frozen=True)
class Placement:
    placement_group: Any
    bundle_indices: tuple[int, ...]  # rank r runs on bundle bundle_indices[r]
    is_owned: bool  # dormant created the group, and removes it at shutdown
    num_gpus_per_worker: float  # 0 on CPUs: a CPU worker takes nothing of its bundle


def resolve_placement(ray: Any, world_size: int, on_gpu: bool, given: Any) -> Placement:
    """The placement group and bundles for ``world_size`` workers; waits until the group is
    reserved. Raises ``UnsupportedOptionError`` when its bundles cannot host the workers (a
    group dormant created is removed again then)."""
    device = "GPU" if on_gpu else "CPU"
    group = given if given is not None else ray.util.get_current_placement_group()
    is_owned = group is None
    if is_owned:
        group = ray.util.placement_group([{device: 1.0}] * world_size, strategy="PACK")
    try:
        _wait_until_ready(ray, group)
        indices = _bundle_indices(group.bundle_specs, world_size, device)
    except BaseException:
        if is_owned:
            ray.util.remove_placement_group(group)
        raise
    per_worker = float(os.environ.get(PER_WORKER_GPUS_VARIABLE, "1")) if on_gpu else 0.0
    return Placement(group, indices, is_owned, per_worker)


def _wait_until_ready(ray: Any, group: Any) -> None:
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        raise UnsupportedOptionError(
            f"the Ray placement group {group.bundle_specs} was not reserved within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s: the cluster lacks the resources (see `ray status`)"
        )


def _bundle_indices(bundles: list[dict[str, float]], world_size: int, device: str) -> tuple:
    named = os.environ.get(BUNDLE_INDICES_VARIABLE)
    if named:
        try:
            indices = [int(index) for index in named.split(",")]
        except ValueError:
            indices = []
        if len(indices) != world_size or len(set(indices)) != len(indices):
            raise UnsupportedOptionError(
                f"{BUNDLE_INDICES_VARIABLE}={named!r} must name {world_size} distinct bundle "
                "indices, one per tensor-parallel rank"
            )
        outside = [i for i in indices if not 0 <= i < len(bundles)]
        if outside:
            raise UnsupportedOptionError(
                f"{BUNDLE_INDICES_VARIABLE}={named!r} names bundles {outside} that the "
                f"placement group does not have (it has {len(bundles)})"
            )
        return tuple(indices)
    with_device = [i for i, bundle in enumerate(bundles) if bundle.get(device, 0) > 0]
    if len(with_device) < world_size:
        raise UnsupportedOptionError(
            f"the placement group has {len(with_device)} bundles with {device} but "
            f"tensor_parallel_size={world_size} needs {world_size} (bundles: {bundles})"
        )
    return tuple(with_device[:world_size])
