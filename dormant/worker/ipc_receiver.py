"""The engine's side of ``update_weights_from_tensor`` on one rank: rebuild, plan, copy.

Per bucket, what used to cost more than the copy itself (H200, 512 MiB buckets: opening the
handle 0.43 ms, unflattening 0.17, enqueueing ~13 copies 0.33, closing the handle 0.18; the copy
0.25) is avoided where the trainer's buckets allow it:

    cost                         avoided by                              when
    ───────────────────────────  ──────────────────────────────────────  ─────────────────────────
    open and close the handle    ``IpcHandles``: the last payload's      the sender reuses its
                                 storages stay open until the next one   buffer (verl's way)
    unflatten, validate, trace   ``CopyPlans``: one plan per bucket       every refit but the first
                                 layout, built once                       of a bucket layout
    unpickle and read the        ``PayloadSkeletons``: a bucket's layout  the same pickle outside
    metadata, find the plan      kept by its bytes outside the tensor's   the tensor's arguments
                                 arguments; the plan is found by the      (every refit but the
                                 layout's identity                        first)
    one copy per tensor          the plan's merged runs                   tensors adjacent in the
                                                                          bucket and in the pool

Holding handles between buckets (``ipc_handles.IpcHandles``, its own map of opened storages by
(handle, offset); torch's ``rebuild_cuda_tensor`` is not called for them): the storages of the
last payload are kept until the next payload was rebuilt (then dropped, unless it reused them),
or until ``release()``, which the worker calls on any command that ends the refit
(``IPC_REFIT_COMMANDS`` keep them). A held storage costs a view, the release of this share's
ref-counter in a file mapped once (``ipc_counters.py``) and a wait on this share's IPC event: a
reused buffer is never read before the writes the sender made before sharing it.

Memory: the receiver allocates nothing for a held handle (it maps the sender's memory). What the
sender cannot free while it is held is the last payload's allocations: at most one bucket beyond
what the sender holds itself (a sender that frees each bucket gets it back at the next bucket, or
at ``release()``); a sender that reuses its buffers holds nothing extra.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import Tensor

from dormant.core.commands import Command
from dormant.core.errors import UnsupportedOptionError
from dormant.models import CausalLM
from dormant.worker.copy_plan import BucketItem, BucketLayout
from dormant.worker.copy_plans import CopyPlans
from dormant.worker.ipc_handles import IpcHandles
from dormant.worker.ipc_payload import (
    LocalSerializedTensor,
    SerializedEntry,
    deserialize_payload,
    rank_entry,
)
from dormant.worker.ipc_skeletons import PayloadSkeletons
from dormant.worker.ipc_weights import FLATTENED_BUCKET, LOAD_FORMATS
from dormant.worker.transfer_errors import WeightTransferError
from dormant.worker.weight_routes import Draft, WeightRoutes

# Commands between which a refit's handles stay open: the refit itself and read-only queries.
# Any other (execute, sleep, wake_up, shutdown...) ends the refit and releases them first.
IPC_REFIT_COMMANDS = frozenset(
    {
        Command.UPDATE_WEIGHTS_FROM_TENSOR,
        Command.SLEEP_STATE,
        Command.MEMORY_STATUS,
        Command.CHECK_HEALTH,
    }
)


class IpcReceiver:
    """One rank's receiver: the handles of the refit in progress and the plans of its buckets."""

    def __init__(self, handles: IpcHandles | None = None) -> None:
        self.handles = handles if handles is not None else IpcHandles()
        self.plans = CopyPlans()
        self.skeletons = PayloadSkeletons()

    def update_weights_from_tensor(
        self,
        model: CausalLM,
        serialized_named_tensors: SerializedEntry | Sequence[SerializedEntry],
        *,
        load_format: str | None = None,
        tp_rank: int = 0,
        draft: Draft | None = None,
    ) -> set[str]:
        """Rebuilds this rank's entry and writes it into ``model`` and ``draft`` (speculative
        decoding's: the names it owns go to it, ``weight_routes.py``); returns the names
        written, as the rank's record has them.

        Raises ``UnsupportedOptionError`` for an unknown ``load_format``, ``WeightTransferError``
        when the entry cannot be rebuilt (nothing was written), ``WeightError`` when a name,
        shape or dtype does not fit (nothing was written), and ``WeightTransferError`` when a
        copy fails (the observer was told: every weight is stale). On any error the held
        handles are released.
        """
        try:
            if load_format not in LOAD_FORMATS:
                raise UnsupportedOptionError(
                    f"load_format={load_format!r} is not supported for "
                    f"update_weights_from_tensor; use one of {LOAD_FORMATS}"
                )
            entry = rank_entry(serialized_named_tensors, tp_rank)
            routes = WeightRoutes(model, draft)
            if load_format == FLATTENED_BUCKET:
                bucket = self.skeletons.read(entry, self.handles.rebuild_cuda_tensor)
                written = self._run_bucket(routes, *bucket)
            else:
                payload = deserialize_payload(entry, self.handles.rebuild_cuda_tensor)
                named = [(name, _unwrap(value, tp_rank)) for name, value in _named_pairs(payload)]
                written = routes.apply_named_tensors(named)
        except BaseException:
            self.handles.release()
            raise
        self.handles.end_payload()
        return written

    def _run_bucket(
        self, routes: WeightRoutes, flat_bytes: Tensor, items: BucketLayout
    ) -> set[str]:
        """Plans the target's entries against the target and the draft's against the draft
        (both plans built, so every entry validated, before either runs), then runs them."""
        target_items, draft_items = _split_items(routes, items)
        plans = self.plans
        target_plan = plans.get(routes.target, target_items) if target_items or not items else None
        draft_plan = plans.get(routes.draft_model, draft_items) if draft_items else None
        written = target_plan.run(routes.target, flat_bytes) if target_plan else set()
        if draft_plan is not None:
            written |= routes.recorded(draft_plan.run(routes.draft_model, flat_bytes))
        return written

    def release(self) -> None:
        """Ends the refit: closes the held handles (the plans stay, for the next refit)."""
        self.handles.release()


def update_weights_from_tensor(
    model: CausalLM,
    serialized_named_tensors: SerializedEntry | Sequence[SerializedEntry],
    *,
    load_format: str | None = None,
    tp_rank: int = 0,
) -> set[str]:
    """``IpcReceiver.update_weights_from_tensor`` with a receiver of its own: nothing is held
    after it returns, and no plan is kept."""
    receiver = IpcReceiver()
    try:
        return receiver.update_weights_from_tensor(
            model, serialized_named_tensors, load_format=load_format, tp_rank=tp_rank
        )
    finally:
        receiver.release()


def _split_items(
    routes: WeightRoutes, items: BucketLayout
) -> tuple[Sequence[BucketItem], Sequence[BucketItem]]:
    """``(target's, draft's)`` items of a bucket, the draft's under the draft model's names.
    Without a draft, the layout itself is the target's (its plan is found by identity)."""
    if routes.draft is None:
        return items, ()
    target, draft = routes.split((item.name, item) for item in items)
    return [item for _, item in target], [replace(item, name=name) for name, item in draft]


def _named_pairs(payload: Any) -> list[tuple[str, Any]]:
    if isinstance(payload, Mapping):
        payload = list(payload.items())
    if not isinstance(payload, list | tuple) or not all(
        isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)
        for item in payload
    ):
        raise WeightTransferError(
            "a named-tensors entry must be a list of (name, tensor) pairs; nothing was written"
        )
    return [(name, value) for name, value in payload]


def _unwrap(value: Any, tp_rank: int) -> Tensor:
    if isinstance(value, LocalSerializedTensor):
        return value.get(tp_rank)
    if not isinstance(value, Tensor):
        raise WeightTransferError(f"expected a tensor, got {type(value).__name__}")
    return value
