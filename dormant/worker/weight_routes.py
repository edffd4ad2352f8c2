"""Where each name of a refit lands on one rank: the target model, or speculative decoding's draft.

Every refit path (``update_weights``, ``update_weights_from_tensor`` with named tensors or a
flattened bucket, ``update_weights_from_distributed``, and the model object's ``load_weights``
that TRL and OpenRLHF call, ``...model_runner.model.load_weights``) routes names through one
``WeightRoutes``, so all of them take the same names::

    draft               the draft's names                    in the draft model as
    ──────────────────  ───────────────────────────────────  ──────────────────────────────
    none                none: every name is the target's      -
    a draft model       ``draft.<its checkpoint name>``       the name, prefix stripped
    MTP                 the checkpoint's ``model.mtp_layers.*``  the name as it is

A draft names the names it owns (``own_name``) and how its record names them
(``recorded_name``): ``draft_model.DraftModel`` and ``mtp_draft.MTPDraftModel``.

With a draft, ``attach`` makes the routes the target model's ``weight_router``
(``models/base.py``), so ``model.load_weights`` on the target routes as ``update_weights`` does
(``route_weights``); the routes themselves write the target through ``load_own_weights``.

Each path validates the target's names and the draft's (``check_weights``: ``WeightError``
naming the bad entries) before writing any, and writes through the models' ``load_weights`` or
copy plans, whose observers report to the rank's one ``RefitRecord``: a write that fails partway,
in either model, marks every weight stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Protocol, TypeVar, cast

import torch
from torch import Tensor

from dormant.models import CausalLM
from dormant.worker import ipc_weights

T = TypeVar("T")
Pairs = list[tuple[str, T]]


class Draft(Protocol):
    """What routing needs of a draft (``DraftModel``, ``MTPDraftModel``)."""

    @property
    def model(self) -> object: ...

    def own_name(self, name: str) -> str | None:
        """The draft model's name for a refit's ``name``, or None when it is the target's."""
        ...

    def recorded_name(self, name: str) -> str:
        """The rank's record's name for the draft model's ``name``."""
        ...


@dataclass(frozen=True)
class WeightRoutes:
    """The target model of a rank and its draft (None: no speculation)."""

    target: CausalLM
    draft: Draft | None = None

    @property
    def draft_model(self) -> CausalLM:
        assert self.draft is not None
        return cast(CausalLM, self.draft.model)  # an MTPDraft quacks like one for refits

    def split(self, items: Iterable[tuple[str, T]]) -> tuple[Pairs[T], Pairs[T]]:
        """``(target's, draft's)`` of ``(name, value)`` pairs; the draft's under its own names."""
        target: Pairs[T] = []
        draft: Pairs[T] = []
        for name, value in items:
            own = self.draft.own_name(name) if self.draft is not None else None
            if own is None:
                target.append((name, value))
            else:
                draft.append((own, value))
        return target, draft

    def check_weights(self, items: Sequence[tuple[str, torch.Size, torch.dtype]]) -> None:
        """Raises ``WeightError`` unless every ``(name, shape, dtype)`` fits where it lands."""
        target, draft = self.split((name, (shape, dtype)) for name, shape, dtype in items)
        self.target.check_weights([(name, *meta) for name, meta in target])
        if draft:
            self.draft_model.check_weights([(name, *meta) for name, meta in draft])

    def recorded(self, draft_names: Iterable[str]) -> set[str]:
        assert self.draft is not None
        return {self.draft.recorded_name(name) for name in draft_names}

    def apply_named_tensors(self, named: Sequence[tuple[str, Tensor]]) -> set[str]:
        """``ipc_weights.apply_named_tensors`` into both models; every entry of both is
        validated before anything is written. Returns the names as the record has them."""
        target, draft = self.split(named)
        if not draft:
            return ipc_weights.apply_named_tensors(self.target, list(target))
        self.check_weights([(name, t.shape, t.dtype) for name, t in named])
        written = ipc_weights.apply_named_tensors(self.target, list(target)) if target else set()
        draft_written = ipc_weights.apply_named_tensors(self.draft_model, list(draft))
        return written | self.recorded(draft_written)

    def attach(self) -> None:
        """Makes these routes the target's ``weight_router``: its ``load_weights`` (the model
        object's, as frameworks call it) then routes the draft's names (``route_weights``)."""
        self.target.weight_router = self

    def route_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """The target model object's ``load_weights``: as ``update_weights``, the weights must be
        awake (``EngineAsleepError``) and every entry of both models fit (``WeightError``)
        before anything is written. ``weights`` is held as a list while it is checked (TRL and
        OpenRLHF pass one tensor, or a list, per call)."""
        items = list(weights)
        if self.target.weight_observer is not None:
            self.target.weight_observer.before_write()  # asleep: refused, nothing marked stale
        self.check_weights([(name, tensor.shape, tensor.dtype) for name, tensor in items])
        return self.load_weights(items)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Streams ``weights`` into both models (``load_weights`` per run of consecutive names
        of one model). A source that fails partway marks every weight stale, whether it fails
        inside a ``load_weights`` call (whose observer tells the record) or between two (this
        tells it). Check the names first (``check_weights``)."""
        if self.draft is None:
            return self.target.load_own_weights(weights)
        draft = self.draft
        written: set[str] = set()
        try:
            for is_draft, run in groupby(
                weights, key=lambda item: draft.own_name(item[0]) is not None
            ):
                if is_draft:
                    written |= self.recorded(self.draft_model.load_weights(_own_names(draft, run)))
                else:
                    written |= self.target.load_own_weights(run)
        except BaseException:
            if self.target.weight_observer is not None:
                self.target.weight_observer.failed()
            raise
        return written


def _own_names(draft: Draft, run: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    for name, tensor in run:
        own = draft.own_name(name)
        assert own is not None
        yield own, tensor
