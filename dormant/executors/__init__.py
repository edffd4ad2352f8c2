"""Executors: how the engine reaches its workers (see ``base.Executor``)."""

from __future__ import annotations

from dormant.core.config import EngineConfig
from dormant.executors.base import Executor
from dormant.executors.uniproc import UniprocExecutor


def make_executor(config: EngineConfig) -> Executor:
    """In-process for one rank; one process per rank ("mp"); this process as one rank of a
    ``torchrun`` launch ("external_launcher"); or one Ray actor per rank ("ray", also the
    choice when a ``placement_group`` is given, as in vLLM). Ray is imported only here."""
    backend = config.distributed_executor_backend
    if backend == "external_launcher":
        from dormant.executors.external_launcher import external_launcher_executor

        return external_launcher_executor(config)
    if backend == "ray" or (backend is None and config.placement_group is not None):
        from dormant.executors.ray_executor import RayExecutor

        return RayExecutor(config)
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(config)
    from dormant.executors.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)


__all__ = ["Executor", "UniprocExecutor", "make_executor"]
