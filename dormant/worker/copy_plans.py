"""The copy plans a rank keeps between refits: one per (model, bucket layout), built once.

A trainer sends the same buckets every refit, so a plan (``copy_plan.py``) is found again by its
layout and used while ``is_valid_for`` says its model's weights are where it was built against;
otherwise it is built again. At most ``MAX_PLANS_PER_MODEL`` layouts are kept per model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from weakref import WeakKeyDictionary

from dormant.models import CausalLM
from dormant.worker.copy_plan import BucketItem, BucketLayout, CopyPlan
from dormant.worker.plan_builder import build_plan

MAX_PLANS_PER_MODEL = 1024  # distinct bucket layouts kept per model; the oldest goes first


class CopyPlans:
    """Plans by model and bucket layout. Models are held weakly: a dropped model drops its plans
    and the parameter views they hold. ``num_built`` counts the plans built (a cache miss)."""

    def __init__(self) -> None:
        self._plans: WeakKeyDictionary[CausalLM, dict[tuple[Any, ...], CopyPlan]]
        self._plans = WeakKeyDictionary()
        self.num_built = 0

    def get(self, model: CausalLM, items: Sequence[BucketItem]) -> CopyPlan:
        """The plan of ``items`` for ``model``: the kept one while it is valid for the model
        (``is_valid_for``), else a new one (``build_plan``: raises before anything is kept)."""
        plans = self._plans.get(model)
        if plans is None:
            plans = self._plans[model] = {}
        key = items if isinstance(items, BucketLayout) else BucketLayout(items)
        plan = plans.get(key)
        if plan is None or not plan.is_valid_for(model):
            plan = build_plan(model, items)  # raises before anything is cached
            self.num_built += 1
            plans.pop(key, None)
            if len(plans) >= MAX_PLANS_PER_MODEL:
                del plans[next(iter(plans))]
            plans[key] = plan
        return plan

    def of(self, model: CausalLM) -> list[CopyPlan]:
        """The plans kept for ``model``, oldest first."""
        return list(self._plans.get(model, {}).values())

    def clear(self) -> None:
        self._plans.clear()
