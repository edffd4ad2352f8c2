"""The refit paths of one rank: every one writes through ``model.load_weights``, so the model's
``RefitRecord`` hears of each write, and of a failure partway (DESIGN §3 invariant 8).

    path                               where the weights come from
    ─────────────────────────────────  ─────────────────────────────────────────────────────
    reload_weights(path)               the checkpoint on disk (or the seeded init for dummy)
    update_weights(pairs)              tensors in this process (host or device; floats cast)
    update_weights_from_tensor(...)    CUDA IPC handles from another process (SGLang's formats)
    update_weights_from_distributed    a broadcast over a weight-update group (NCCL / gloo)

Each checks that the memory it writes is awake first, and validates every name, shape and dtype
before writing any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import cast

import torch

from dormant.core.config import EngineConfig
from dormant.core.errors import EngineAsleepError
from dormant.memory import RUNTIME, WEIGHTS, MemoryManager
from dormant.models import CausalLM, iterate_safetensors, iterate_safetensors_metadata
from dormant.worker import ipc_weights
from dormant.worker.draft_model import DraftModel
from dormant.worker.group_broadcasts import DTypeLike
from dormant.worker.ipc_receiver import IpcReceiver
from dormant.worker.mtp_draft import MTPDraftModel
from dormant.worker.update_group import WeightUpdateGroups
from dormant.worker.weight_routes import WeightRoutes

# Serialized entries (one per TP rank, or one for all), or named tensors in-process.
TensorPayload = (
    ipc_weights.SerializedEntry | Sequence[ipc_weights.SerializedEntry] | ipc_weights.NamedTensors
)


def check_awake(mm: MemoryManager, what: str, *tags: str) -> None:
    """Raises EngineAsleepError unless every one of ``tags`` is awake: reading or writing
    memory that is asleep is a segfault on the host and an illegal address on the GPU."""
    asleep = [tag for tag in tags if mm.is_sleeping(tag)]  # per bucket of a refit: cheap
    if asleep:
        raise EngineAsleepError(
            f"{what} needs {asleep} awake; wake_up({asleep}) first (for a refit: "
            "wake_up(['weights']), then refit)"
        )


class Refitter:
    """Refits the model of one rank (``tp_rank``) in place; returns the names written."""

    def __init__(
        self,
        config: EngineConfig,
        mm: MemoryManager,
        model: Callable[[], CausalLM],
        tp_rank: int,
        draft: Callable[[], DraftModel | MTPDraftModel | None] = lambda: None,
    ) -> None:
        self.config, self.mm, self._model, self.tp_rank = config, mm, model, tp_rank
        self._draft = draft  # speculative decoding's draft model: refit with the target
        device = "cpu" if mm.backend.device.type != "cuda" else mm.backend.device
        self.groups = WeightUpdateGroups(tp_rank, device=device)
        self.ipc = IpcReceiver()  # the open handles of an IPC refit, and its buckets' plans

    def reload_weights(self, path: str | None = None) -> tuple[str, ...]:
        """Re-reads the checkpoint (or re-runs the seeded init) into the existing tensors, and
        a draft model's (``DraftModel.load``: from ``path`` too under self-speculation)."""
        self._check_writable("reload_weights")
        names = self.load_checkpoint(path or self.config.model)
        draft = self._draft()
        if draft is not None:
            names = _sorted((*names, *draft.load(path or self.config.model)))
        return names

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
        """HF-named tensors (floats of any dtype, cast on copy), validated before any write;
        a draft model's under ``draft.`` (``worker/draft_model.py``), MTP layers' under their
        checkpoint names (``worker/mtp_draft.py``); every refit path routes names this way
        (``worker/weight_routes.py``)."""
        self._check_writable("update_weights")
        return _sorted(self._routes().apply_named_tensors(list(weights)))

    def update_weights_from_tensor(
        self, named_tensors: TensorPayload, load_format: str | None = None
    ) -> tuple[str, ...]:
        """SGLang's ``update_weights_from_tensor``: this rank's entry of serialized IPC handles
        (named tensors, or a ``"flattened_bucket"``), or, in-process, the named tensors; the
        draft's names as ``update_weights`` takes them."""
        self._check_writable("update_weights_from_tensor")
        if isinstance(named_tensors, list) and _is_named_tensors(named_tensors):
            return _sorted(self._routes().apply_named_tensors(named_tensors))
        entries = cast(
            ipc_weights.SerializedEntry | Sequence[ipc_weights.SerializedEntry], named_tensors
        )
        names = self.ipc.update_weights_from_tensor(
            self._model(), entries, load_format=load_format, tp_rank=self.tp_rank,
            draft=self._draft(),
        )  # fmt: skip
        return _sorted(names)

    def end_ipc_refit(self) -> None:
        """Closes the IPC handles held between buckets (``ipc_receiver.py``): the worker calls
        it before any command that is not part of a refit."""
        self.ipc.release()

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        self.groups.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[DTypeLike],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        packed_bytes: int | None = None,
    ) -> tuple[str, ...]:
        """Receives a broadcast from the trainer (rank 0 of the group) in bounded buckets; the
        draft's names as ``update_weights`` takes them. Every refusal leaves the group in step
        (the broadcasts received and dropped: the weights asleep, a name that does not fit) or
        destroyed (lists that do not say what arrives), as ``update_group.py``'s table says."""
        names_written = self.groups.update_weights_from_distributed(
            self._model(), names, dtypes, shapes, group_name, load_format=load_format,
            packed_bytes=packed_bytes, draft=self._draft(),
            check_writable=partial(self._check_writable, "update_weights_from_distributed"),
        )  # fmt: skip
        return _sorted(names_written)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self.groups.destroy_weights_update_group(group_name)

    def _routes(self) -> WeightRoutes:
        return WeightRoutes(self._model(), self._draft())

    def load_checkpoint(self, path: str | None) -> tuple[str, ...]:
        model = self._model()
        if self.config.load_format == "dummy":
            model.init_random_weights(self.config.seed)
            return tuple(model.expected_weight_shapes())
        assert path is not None, "a checkpoint path is required unless load_format='dummy'"
        model.check_weights(list(iterate_safetensors_metadata(path)), require_complete=True)
        return _sorted(model.load_own_weights(iterate_safetensors(path)))  # the draft: its .load

    def _check_writable(self, what: str) -> None:
        """A refit writes parameters (weights) and checkpoint k/v scales (runtime buffers)."""
        check_awake(self.mm, what, WEIGHTS, RUNTIME)


def _sorted(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(names))


def _is_named_tensors(value: object) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(
            isinstance(item, tuple | list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
            for item in value
        )
    )
