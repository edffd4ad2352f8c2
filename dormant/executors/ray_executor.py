"""``RayExecutor`` (``distributed_executor_backend="ray"``): one Ray actor per rank, on the bundles
of a placement group (``ray_placement.py``), across nodes if the group spans them.

It sends each rank the same typed command the multi-process executor sends and gathers the
results in rank order, so every engine feature runs on it unchanged. A rank whose actor dies
(or stops answering) makes the call raise ``EngineDeadError`` at once: every actor is killed
(the survivors may be stuck in a collective with the dead one), a placement group dormant
created is removed, and every later call raises too. Actors are owned by the process that
made the engine, so Ray ends them if that process dies.

Ray is optional (``pip install 'dormant[ray]'``) and imported only by this module.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from dataclasses import replace
from typing import Any

import torch

from dormant.core.commands import Command
from dormant.core.config import EngineConfig
from dormant.core.errors import EngineDeadError, UnsupportedOptionError
from dormant.core.step_input import StepInput
from dormant.core.step_output import StepOutput
from dormant.executors.multiproc import COMMAND_TIMEOUT_S, STARTUP_TIMEOUT_S
from dormant.executors.ray_placement import Placement, resolve_placement
from dormant.executors.ray_worker import RayWorker

STOP_TIMEOUT_S = 30.0
_COPIED_ENV_PREFIXES = ("DORMANT_", "NCCL_")  # the driver's settings the workers need too


def import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise UnsupportedOptionError(
            "distributed_executor_backend='ray' needs Ray, which is not installed: "
            "pip install 'dormant[ray]'"
        ) from error
    return ray


class RayExecutor:
    def __init__(self, config: EngineConfig) -> None:
        ray = self._ray = import_ray()
        if not ray.is_initialized():
            ray.init()  # RAY_ADDRESS's cluster, or a local one (as vLLM does)
        self.world_size = config.tensor_parallel_size
        on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        placement = resolve_placement(ray, self.world_size, on_gpu, config.placement_group)
        self.placement = placement
        worker_config = replace(config, placement_group=None)  # the workers need no handle
        self.workers = [
            _remote_worker(ray, placement, rank, on_gpu).remote(
                worker_config, rank, self.world_size, on_gpu
            )
            for rank in range(self.world_size)
        ]
        self._cleanup = _Cleanup(ray, self.workers, placement)
        self._finalizer = weakref.finalize(self, self._cleanup.kill)
        self._is_dead = False
        self._death: str | None = None  # why the workers are gone, once they died
        try:
            addresses = self._gather([w.address.remote() for w in self.workers], wrapped=False)
            init_method = _init_method(addresses)
            self.pids = self._gather([w.start.remote(init_method) for w in self.workers])
        except BaseException:
            self.shutdown()
            raise

    def run(self, command: Command, *args: Any, **kwargs: Any) -> list[Any]:
        if self._is_dead:
            cause = f" ({self._death})" if self._death else ""
            raise EngineDeadError(f"the engine's Ray workers are gone{cause}; create a new engine")
        message = self._ray.put((command, args, kwargs))  # serialized once for every rank
        return self._gather([w.handle.remote(message) for w in self.workers], COMMAND_TIMEOUT_S)

    def execute(self, step: StepInput) -> StepOutput:
        return self.run(Command.EXECUTE, step)[0]  # every rank sampled the same tokens

    def execute_multi_step(self, step: StepInput) -> StepOutput:
        return self.run(Command.EXECUTE_MULTI_STEP, step)[0]

    def shutdown(self) -> None:
        if not self._is_dead:
            self._is_dead = True
            self._finalizer.detach()
            self._cleanup.stop()

    def _gather(
        self, refs: list[Any], timeout: float = STARTUP_TIMEOUT_S, wrapped: bool = True
    ) -> list[Any]:
        """Each rank's answer, in rank order; the first dead rank ends the engine at once."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending, deadline = list(refs), time.monotonic() + timeout
        while pending:
            ready, pending = ray.wait(pending, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                ranks = sorted(rank_of[ref] for ref in pending)
                self._die(f"no answer from ranks {ranks} in {timeout:.0f} s")
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayError as error:
                    self._die(f"worker rank {rank} died ({type(error).__name__}: {error})")
        if not wrapped:
            return results
        for status, value in results:
            if status == "error":
                raise value
        return [value for _, value in results]

    def _die(self, reason: str) -> None:
        if not self._is_dead:
            self._is_dead, self._death = True, reason
            self._finalizer.detach()
            self._cleanup.kill()  # no goodbye: the survivors may wait on the dead rank
        raise EngineDeadError(f"{reason}; every Ray worker was killed. Create a new engine.")


def _remote_worker(ray: Any, placement: Placement, rank: int, on_gpu: bool) -> Any:
    """The actor class for ``rank``, pinned to its bundle (vLLM's worker options)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    env = {k: v for k, v in os.environ.items() if k.startswith(_COPIED_ENV_PREFIXES)}
    if on_gpu:
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=placement.placement_group,
        placement_group_capture_child_tasks=True,
        placement_group_bundle_index=placement.bundle_indices[rank],
    )
    options: dict[str, Any] = dict(
        num_cpus=0,
        num_gpus=placement.num_gpus_per_worker,
        scheduling_strategy=strategy,
        max_restarts=0,
        name=None,
    )
    if env:
        options["runtime_env"] = {"env_vars": env}
    return ray.remote(RayWorker).options(**options)


def _init_method(addresses: list[tuple[str, int, int]]) -> str:
    """The TP group's rendezvous at rank 0's node (loopback when every rank shares it)."""
    ip, port, _ = addresses[0]
    if len({address[0] for address in addresses}) == 1:
        ip = "127.0.0.1"
    return f"tcp://{ip}:{port}"


class _Cleanup:
    """Ends the actors and a placement group dormant created; holds no reference to the
    executor, so it can run from the executor's finalizer."""

    def __init__(self, ray: Any, workers: list[Any], placement: Placement) -> None:
        self.ray, self.workers, self.placement = ray, workers, placement

    def stop(self) -> None:
        """Lets each worker release its memory first, then kills every actor."""
        if self.ray.is_initialized():
            refs = [worker.stop.remote() for worker in self.workers]
            self.ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        self.kill()

    def kill(self) -> None:
        if not self.ray.is_initialized():  # Ray was shut down: it ended the actors itself
            return
        for worker in self.workers:
            with contextlib.suppress(self.ray.exceptions.RayError):
                self.ray.kill(worker, no_restart=True)
        if self.placement.is_owned:
            self.ray.util.remove_placement_group(self.placement.placement_group)
