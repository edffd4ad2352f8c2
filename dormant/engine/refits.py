"""Refits over every rank, with vLLM's and SGLang's names, and the weight version.

Every path runs on every rank and then asks the ranks which weights are still stale (all of
them after a refit that failed partway: the worker's ``RefitRecord`` decides, not the engine).
``update_weights_from_tensor``, sent once per bucket, is answered with each rank's record
(``RefitReport``), so a bucket that every rank wrote costs one round trip, not two; one that
failed anywhere still asks every rank.
A refit that succeeds may set ``weight_version`` (SGLang's ``get_weight_version``). The prefix
cache is the engine's to invalidate on any weight change, so ``flush_cache`` is accepted for
SGLang's callers and needs no action here. The caller's own code (``run_callers_code``) may
write weights by any means, so it runs the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dormant.core.commands import Command
from dormant.executors import Executor
from dormant.worker.refit_record import RefitReport

Names = list[tuple[str, ...]]  # per rank, in rank order: the names each rank wrote
# Records the ranks' sleep state: asked of every rank (None), or from what a refit reported.
Refresh = Callable[[Sequence[RefitReport] | None], None]


class WeightRefits:
    def __init__(self, executor: Executor, refresh: Refresh) -> None:
        self._executor, self._refresh = executor, refresh
        self.weight_version = "default"  # SGLang's name for weights no refit has named

    def run(self, command: Command, *args: Any, weight_version: str | None = None) -> list[Any]:
        """Runs ``command`` on every rank, then refreshes the ranks' stale-weight record
        whatever happened; records ``weight_version`` only if every rank succeeded."""
        try:
            results = self._executor.run(command, *args)
        finally:
            self._refresh(None)
        if weight_version is not None:
            self.weight_version = weight_version
        return results

    def run_reported(
        self, command: Command, *args: Any, weight_version: str | None = None
    ) -> Names:
        """``run`` for a command every rank answers with a ``RefitReport``: if every rank
        succeeded, the reports are the ranks' records (nothing else a rank reports changes in
        a refit); if any failed, every rank is asked, as ``run`` does."""
        try:
            reports: list[RefitReport] = self._executor.run(command, *args)
        except BaseException:
            self._refresh(None)
            raise
        self._refresh(reports)
        if weight_version is not None:
            self.weight_version = weight_version
        return [report.names for report in reports]

    def run_callers_code(
        self, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        """Runs a method of the ``worker_extension_cls`` (by name) or a callable ``fn(worker,
        *args, **kwargs)`` on every rank, as ``run`` runs a refit. A callable is sent pickled
        by value (cloudpickle), so closures and lambdas reach worker processes too."""
        if callable(method):
            import cloudpickle

            return self.run(Command.CALL_FUNCTION, cloudpickle.dumps(method), args, kwargs)
        return self.run(Command.CALL_EXTENSION, method, args, kwargs)

    def reload_weights(self, path: str | None = None, weight_version: str | None = None) -> Names:
        return self.run(Command.RELOAD_WEIGHTS, path, weight_version=weight_version)

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> Names:
        return self.run(Command.UPDATE_WEIGHTS, list(weights), weight_version=weight_version)

    def update_weights_from_tensor(
        self,
        named_tensors: Any,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> Names:
        """SGLang's: ``named_tensors`` is a list of (name, tensor), or serialized IPC entries
        (one per TP rank, or one for all), plain or as a ``"flattened_bucket"``."""
        if isinstance(named_tensors, tuple):
            named_tensors = list(named_tensors)
        return self.run_reported(
            Command.UPDATE_WEIGHTS_FROM_TENSOR,
            named_tensors,
            load_format,
            weight_version=weight_version,
        )

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> list[None]:
        """SGLang's: every rank joins the trainer's group as rank ``rank_offset + tp_rank``."""
        args = (master_address, master_port, rank_offset, world_size, group_name, backend)
        return self._executor.run(Command.INIT_WEIGHTS_UPDATE_GROUP, *args)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
        packed_bytes: int | None = None,
    ) -> Names:
        """SGLang's: receives the trainer's broadcast of ``names`` on every rank (vLLM's
        weight transfer: ``load_format="packed"``, in chunks of ``packed_bytes``)."""
        args = (list(names), [str(d) for d in dtypes], [list(s) for s in shapes], group_name)
        return self.run(
            Command.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
            *args,
            load_format,
            packed_bytes,
            weight_version=weight_version,
        )

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> list[None]:
        return self._executor.run(Command.DESTROY_WEIGHTS_UPDATE_GROUP, group_name)
