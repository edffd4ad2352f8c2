"""Weight-update groups: the trainer broadcasts new weights to the engine's ranks (SGLang's API).

``group_rendezvous.py`` builds a group; ``group_broadcasts.py`` receives a request's tensors.
The trainer broadcasts beside each ``update_weights_from_distributed`` call whatever the engine
answers, so every outcome leaves the group known: in step (every broadcast of the request
received) or destroyed (the trainer's broadcast over it then fails: over gloo at once, over NCCL
possibly only at the trainer's own timeout)::

    refusal or failure                        broadcasts         weights           group
    ────────────────────────────────────────  ─────────────────  ────────────────  ─────────
    no group of that name                     none received      unchanged         -
    lists or format unreadable (lengths,      none received      unchanged         destroyed
      dtype, shape: what arrives is unknown)
    weights asleep; a name, shape or dtype    received, dropped  unchanged         in step
      that does not fit the model
    ... and a broadcast of it fails           partly received    unchanged         destroyed
    a broadcast fails mid-refit               partly received    every one stale   destroyed
    a write fails mid-refit                   rest dropped       every one stale   in step

Each tensor goes through a ``load_weights`` call fed by ``Broadcasts`` (one call, or one per run
of the target's or the draft's names, ``weight_routes.py``), whose observer marks every weight
stale on a failure partway: the engine refuses to generate until all were written again.
Destroying a group the engine destroyed itself is a no-op, so "destroy, then init" recovers
every rank, whatever each one saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dormant.errors import EngineError
from dormant.models import CausalLM, WeightError
from dormant.worker.group_broadcasts import BroadcastLost, BroadcastRequest, Broadcasts, DTypeLike
from dormant.worker.group_rendezvous import BACKENDS, DEFAULT_TIMEOUT_S, create_update_group
from dormant.worker.group_rendezvous import broadcast_weights as broadcast_weights  # its old home
from dormant.worker.ipc_weights import DEFAULT_BUCKET_BYTES
from dormant.worker.transfer_errors import (
    UpdateGroupDestroyedError,
    UpdateGroupError,
    WeightTransferError,
)
from dormant.worker.weight_routes import Draft, WeightRoutes

STALE = (
    "every weight is marked stale (some may hold new values, some old), so the engine refuses "
    "to generate until all of them are written again"
)
RECREATE = "create it again on both sides (init_weights_update_group)"


class WeightUpdateGroups:
    """The weight-update groups of one engine rank, by name (the worker owns one)."""

    def __init__(
        self,
        tp_rank: int = 0,
        *,
        device: torch.device | str = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.tp_rank = tp_rank
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._destroyed: dict[str, str] = {}  # groups this rank destroyed itself: why

    def names(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        """Joins the trainer's group as rank ``rank_offset + tp_rank``. Raises
        ``UpdateGroupError`` for a bad argument and ``WeightTransferError`` when the rendezvous
        fails or times out; no group is kept then."""
        rank = rank_offset + self.tp_rank
        if group_name in self._groups:
            raise UpdateGroupError(
                f"weight-update group {group_name!r} exists already; destroy it first "
                f"(groups: {list(self._groups)})"
            )
        if backend not in BACKENDS:
            raise UpdateGroupError(f"backend {backend!r} is not one of {BACKENDS}")
        if not 1 <= rank < world_size:
            raise UpdateGroupError(
                f"engine rank {rank} (rank_offset {rank_offset} + tp_rank {self.tp_rank}) is "
                f"outside 1..{world_size - 1}: rank 0 is the trainer"
            )
        try:
            group = create_update_group(
                master_address, master_port, rank, world_size, group_name, backend, self.timeout_s
            )
        except Exception as error:
            raise WeightTransferError(
                f"could not join weight-update group {group_name!r} at "
                f"{master_address}:{master_port} as rank {rank} of {world_size} within "
                f"{self.timeout_s} s ({type(error).__name__}: {error})"
            ) from error
        self._groups[group_name] = group
        self._destroyed.pop(group_name, None)

    def destroy_weights_update_group(self, group_name: str) -> None:
        """Destroys the group; a no-op for one this rank destroyed itself after a failure."""
        if group_name not in self._groups and self._destroyed.pop(group_name, None) is not None:
            return
        dist.destroy_process_group(self.group(group_name))
        del self._groups[group_name]

    def destroy_all(self) -> None:
        for name in list(self._groups):
            self.destroy_weights_update_group(name)

    def update_weights_from_distributed(
        self,
        model: CausalLM,
        names: Sequence[str],
        dtypes: Sequence[DTypeLike],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        *,
        load_format: str | None = None,
        packed_bytes: int | None = None,
        draft: Draft | None = None,
        check_writable: Callable[[], None] = lambda: None,
    ) -> set[str]:
        """Receives rank 0's broadcast of each named tensor and loads it into ``model``, or into
        ``draft`` for the names speculative decoding's draft owns (``weight_routes.py``);
        returns the names written, as the rank's record has them. Each refusal and failure
        leaves what the module's table says, and its error says which: ``UpdateGroupError``
        (no such group), ``UpdateGroupDestroyedError`` (lists or format unreadable),
        ``check_writable``'s ``EngineAsleepError`` or ``WeightError`` (refused, drained),
        ``WeightTransferError`` (a broadcast or a write failed)."""
        self.group(group_name)  # none: UpdateGroupError, nothing received (no local: see below)
        try:
            request = BroadcastRequest.parse(names, dtypes, shapes, load_format, packed_bytes)
        except UpdateGroupError as error:
            self._destroy_broken(group_name, f"a request it could not read: {error}")
            raise UpdateGroupDestroyedError(
                f"{error}. The engine cannot tell what the trainer broadcasts beside this "
                f"request, so it received nothing, wrote no weight and destroyed weight-update "
                f"group {group_name!r}, so that the trainer's broadcast over it fails (over gloo "
                "at once; over NCCL possibly only at the trainer's own timeout). Destroy the "
                f"trainer's side, {RECREATE}, and send lists and a format that match the "
                "broadcast."
            ) from None
        broadcasts = Broadcasts(
            self._groups[group_name], request, device=self.device,
            bucket_bytes=self.bucket_bytes, timeout_s=self.timeout_s,
        )  # fmt: skip
        routes = WeightRoutes(model, draft)
        try:
            check_writable()
            request.check_names()
            routes.check_weights(request.metas())
        except Exception as refusal:
            raise self._drain_refused(group_name, broadcasts, refusal) from None
        try:
            return routes.load_weights(broadcasts)
        except Exception as error:
            raise self._write_failed(group_name, broadcasts, error) from error

    def _drain_refused(
        self, group_name: str, broadcasts: Broadcasts, refusal: Exception
    ) -> Exception:
        """Receives and drops a refused request's broadcasts: left unreceived, the trainer would
        wait on them, or the next request would receive them. Returns the error to raise."""
        try:
            broadcasts.drop_rest()
        except BroadcastLost as lost:
            self._destroy_broken(group_name, str(lost), broadcasts)
            return WeightTransferError(
                f"refused ({type(refusal).__name__}: {refusal}); then, over weight-update group "
                f"{group_name!r}, {lost}. No weight was written: the weights are as they were. "
                f"The group was destroyed: {RECREATE}, then send the weights."
            )
        return _restated(
            refusal,
            f"No weight was written, and the request's broadcasts were received and dropped: "
            f"weight-update group {group_name!r} is in step, so send the request again over it.",
        )

    def _write_failed(
        self, group_name: str, broadcasts: Broadcasts, error: Exception
    ) -> WeightTransferError:
        """After a failure partway through a refit (the observer marked every weight stale):
        receives the rest, if the broadcasts are intact, or destroys the group."""
        was_lost = broadcasts.lost is not None
        if not was_lost:
            with contextlib.suppress(BroadcastLost):
                broadcasts.drop_rest()
        request = broadcasts.request
        lost = broadcasts.lost
        if lost is None:
            return WeightTransferError(
                f"weight-update group {group_name!r}: writing the weights failed after "
                f"{broadcasts.num_received} of {len(request.specs)} tensors arrived "
                f"({type(error).__name__}: {error}). The weights are partly written: {STALE}. "
                "The rest of the request's broadcasts were received and dropped, so the group "
                "is in step: send every weight again over it."
            )
        self._destroy_broken(group_name, str(lost), broadcasts)
        what = f"{lost}" if was_lost else f"writing failed ({error}); then {lost}"
        return WeightTransferError(
            f"weight-update group {group_name!r}: {what}. The weights may be partly written: "
            f"{STALE}. The group was destroyed: {RECREATE}, then send every weight."
        )

    def group(self, group_name: str) -> dist.ProcessGroup:
        """The group named ``group_name``, for a caller's own collectives over it (a
        benchmark's plain broadcast); ``UpdateGroupError`` when there is none."""
        if group_name in self._groups:
            return self._groups[group_name]
        if group_name in self._destroyed:
            raise UpdateGroupError(
                f"weight-update group {group_name!r} was destroyed "
                f"({self._destroyed[group_name]}): {RECREATE}"
            )
        raise UpdateGroupError(
            f"no weight-update group {group_name!r} (groups: {list(self._groups)}); call "
            "init_weights_update_group first"
        )

    def _destroy_broken(
        self, group_name: str, reason: str, broadcasts: Broadcasts | None = None
    ) -> None:
        """Aborts a group out of step with the trainer (or about to be) and drops every
        reference to it, so that the trainer's broadcast over it fails instead of waiting: a
        gloo group closes its connections only once it is freed, not on abort, so no frame of
        a traceback (which the caller may keep) may hold it (``Broadcasts.release``)."""
        if broadcasts is not None:
            broadcasts.release()
        c10d._abort_process_group(self._groups.pop(group_name))
        self._destroyed[group_name] = reason


def _restated(error: Exception, note: str) -> Exception:
    """``error`` with ``note`` after its message, of the same type (callers and the server's
    status map key on it)."""
    if isinstance(error, WeightError):
        return WeightError(error.problems, f"{error.hint} {note}")
    if isinstance(error, EngineError) and len(error.args) == 1:
        text = str(error)
        with contextlib.suppress(TypeError):
            return type(error)(f"{text}{' ' if text.endswith('.') else '. '}{note}")
    error.add_note(note)
    return error
