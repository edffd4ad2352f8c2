"""Weight-update groups: the trainer broadcasts new weights to the engine's ranks (SGLang's API).

A group has ``world_size`` ranks: the trainer is rank 0 and engine TP rank ``t`` is
``rank_offset + t``. It is built the way SGLang, slime and OpenRLHF build theirs (a TCP
rendezvous on the trainer's ``master_address:master_port``, a ``PrefixStore`` named after the
group, torch's process-group helper), so a trainer using their ``init_custom_process_group``
can join it, and it never touches torch.distributed's default group, which the engine may use
for its own TP group.

Receiving, per ``update_weights_from_distributed`` call::

    load_format         what rank 0 broadcasts           what this rank holds at once
    ──────────────────  ───────────────────────────────  ────────────────────────────────────
    None                each tensor, in the listed order  one bucket of receive buffers
                                                          (≤ bucket_bytes, or one larger tensor)
    "flattened_bucket"  one uint8 buffer: the tensors'    that buffer (the trainer sizes it)
                        bytes back to back, in order

Every tensor goes through a ``load_weights`` call fed by a generator (one call, or one per run
of consecutive names of the target or of speculative decoding's draft, ``weight_routes.py``), so
a broadcast that fails or times out partway fails such a call, and the model's observer marks
every weight stale. A request whose names or shapes do not fit, or that comes while the weights
are asleep, is refused before anything is written; its broadcasts are still received (and
dropped), so the trainer is not left blocked and the next request does not receive them. A
failed broadcast destroys the group: the trainer must create it again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as c10d

from dormant.core.errors import EngineAsleepError
from dormant.models import CausalLM, WeightError
from dormant.worker.ipc_weights import DEFAULT_BUCKET_BYTES, FLATTENED_BUCKET
from dormant.worker.transfer_errors import UpdateGroupError, WeightTransferError
from dormant.worker.weight_routes import Draft, WeightRoutes

DEFAULT_TIMEOUT_S = 60.0
BACKENDS = ("nccl", "gloo")
DTypeLike = torch.dtype | str


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def create_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dist.ProcessGroup:
    """Joins (rank 0: hosts) the rendezvous and builds the group; both sides call this. Blocks
    until all ``world_size`` ranks joined or ``timeout_s`` passed."""
    timeout = timedelta(seconds=timeout_s)
    init_method = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=c10d.GroupName(group_name),
        timeout=timeout,
    )
    # Group rank == "global" rank, so torch.distributed.broadcast(..., src=0, group=g) works.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_weights(
    group: dist.ProcessGroup, named_tensors: Sequence[tuple[str, Tensor]], timeout_s: float
) -> None:
    """The trainer's side (rank 0) of a ``load_format=None`` update: broadcasts each tensor."""
    for _, tensor in named_tensors:
        _wait(group.broadcast([tensor.contiguous()], _from_rank0()), timeout_s)


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

    def destroy_weights_update_group(self, group_name: str) -> None:
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
        draft: Draft | None = None,
        check_writable: Callable[[], None] = lambda: None,
    ) -> set[str]:
        """Receives rank 0's broadcast of each named tensor and loads it into ``model``, or into
        ``draft`` for the names speculative decoding's draft owns (``weight_routes.py``);
        returns the names written, as the rank's record has them. Raises ``WeightError`` when a
        name, shape or dtype does not fit, or ``check_writable``'s ``EngineAsleepError`` (both:
        nothing written, the broadcasts were drained), ``WeightTransferError`` (every weight
        marked stale, the group destroyed) when a broadcast fails or times out, and
        ``UpdateGroupError`` for an unknown group, format or malformed lists (nothing received
        or written)."""
        group = self.group(group_name)
        specs = _specs(names, dtypes, shapes)
        if load_format not in (None, FLATTENED_BUCKET):
            raise UpdateGroupError(f"load_format={load_format!r}: use None or {FLATTENED_BUCKET!r}")
        routes = WeightRoutes(model, draft)
        try:
            check_writable()
            routes.check_weights([(s.name, s.shape, s.dtype) for s in specs])
        except (EngineAsleepError, WeightError):
            # Keep in step with the trainer, which is broadcasting them: left unreceived, they
            # would be the next request's tensors. Nothing is written.
            for _ in self._receive(group_name, group, specs, load_format):
                pass
            raise
        return routes.load_weights(self._receive(group_name, group, specs, load_format))

    def _receive(
        self,
        group_name: str,
        group: dist.ProcessGroup,
        specs: list[TensorSpec],
        load_format: str | None,
    ) -> Iterator[tuple[str, Tensor]]:
        """Yields each received tensor; holds one bucket of buffers at a time."""
        buckets = [specs] if load_format == FLATTENED_BUCKET else _buckets(specs, self.bucket_bytes)
        num_received = 0
        for bucket in buckets:
            if load_format == FLATTENED_BUCKET:
                num_bytes = sum(s.nbytes for s in bucket)
                received = [torch.empty(num_bytes, dtype=torch.uint8, device=self.device)]
            else:
                received = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in bucket]
            works = [group.broadcast([b], _from_rank0()) for b in received]  # pipelined
            try:
                for work in works:
                    _wait(work, self.timeout_s)
            except Exception as error:
                self._drop_broken(group_name)
                raise WeightTransferError(
                    f"weight-update group {group_name!r}: the broadcast failed after "
                    f"{num_received} of {len(specs)} tensors ({type(error).__name__}: {error}). "
                    "The group was destroyed and every weight is marked stale: create the group "
                    "again and send every weight."
                ) from error
            num_received += len(bucket)
            is_flat = load_format == FLATTENED_BUCKET
            buffers = _views(received[0], bucket) if is_flat else received
            yield from zip((s.name for s in bucket), buffers, strict=True)
            del buffers, received, works

    def group(self, group_name: str) -> dist.ProcessGroup:
        """The group named ``group_name``, for a caller's own collectives over it (a
        benchmark's plain broadcast); ``UpdateGroupError`` when there is none."""
        if group_name not in self._groups:
            raise UpdateGroupError(
                f"no weight-update group {group_name!r} (groups: {list(self._groups)}); call "
                "init_weights_update_group first"
            )
        return self._groups[group_name]

    def _drop_broken(self, group_name: str) -> None:
        group = self._groups.pop(group_name)
        c10d._abort_process_group(group)


def _specs(
    names: Sequence[str], dtypes: Sequence[DTypeLike], shapes: Sequence[Sequence[int]]
) -> list[TensorSpec]:
    if not len(names) == len(dtypes) == len(shapes):
        raise UpdateGroupError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
            f"{len(shapes)})"
        )
    return [
        TensorSpec(name, _dtype(dtype), torch.Size(shape))
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True)
    ]


def _dtype(dtype: DTypeLike) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise UpdateGroupError(f"unknown dtype {dtype!r} (expected e.g. 'bfloat16')")
    return found


def _buckets(specs: list[TensorSpec], bucket_bytes: int) -> Iterator[list[TensorSpec]]:
    bucket: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if bucket and size + spec.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(spec)
        size += spec.nbytes
    if bucket:
        yield bucket


def _views(flat: Tensor, specs: list[TensorSpec]) -> list[Tensor]:
    """Each tensor's bytes as its dtype (a slice not aligned to its dtype is copied out after
    the broadcast filled it: one tensor's bytes)."""
    views, offset = [], 0
    for spec in specs:
        part = flat[offset : offset + spec.nbytes]
        part = part.clone() if offset % spec.dtype.itemsize else part
        views.append(part.view(spec.dtype).reshape(spec.shape))
        offset += spec.nbytes
    return views


def _from_rank0() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def _wait(work: dist.Work, timeout_s: float) -> None:
    if not work.wait(timedelta(seconds=timeout_s)):
        raise TimeoutError(f"timed out after {timeout_s} s")
