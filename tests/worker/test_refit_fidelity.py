"""Refit paths as the RL frameworks really drive them: a worker extension built the way vLLM
builds it (verl's ``__new__(cls, **kwargs)``; conflicts found through the extension's bases), and
a weight-update group kept in step with the trainer when a refit is refused because the weights
are asleep, or fails partway through writing them (then the engine refuses to generate until a
complete refit)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from dormant import LLM
from dormant.core.errors import EngineAsleepError, WeightsNotLoadedError
from dormant.executors.multiproc import free_port
from dormant.models import weights as weight_io
from dormant.worker.extension import WorkerExtensionError
from dormant.worker.transfer_errors import WeightTransferError
from dormant.worker.update_group import broadcast_weights, create_update_group
from tests.engine.conftest import GREEDY, PROMPTS, hf_state_dict, tokens, write_checkpoint
from tests.worker.group_trainer import failing_write

GROUP = "refit"
HERE = "tests.worker.test_refit_fidelity"


class KeywordNewExtension:
    """verl's ``vLLMColocateWorkerExtension`` (verl/workers/rollout/vllm_rollout/utils.py
    L133-150) defines ``__new__(cls, **kwargs)``: vLLM builds its workers with keyword
    arguments only (``worker_class(**kwargs)``)."""

    rank: int

    def __new__(cls, **kwargs: Any) -> KeywordNewExtension:
        return super().__new__(cls)

    def rank_of(self) -> int:
        return self.rank


class SleepMixin:
    def sleep(self) -> None:  # the worker has a sleep
        pass


class InheritedConflictExtension(SleepMixin):
    """A conflict through a base class: vLLM checks ``dir(extension)``, bases included."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return (
        write_checkpoint(tmp_path_factory.mktemp("ckpt_a"), seed=1),
        write_checkpoint(tmp_path_factory.mktemp("ckpt_b"), seed=2),
    )


@pytest.fixture
def make_llm() -> Iterator[Any]:
    engines: list[LLM] = []

    def make(model: Path, **options: Any) -> LLM:
        defaults = dict(device="cpu", max_model_len=256, max_num_seqs=8, seed=0)
        llm = LLM(str(model), **{**defaults, "kv_cache_memory_bytes": 4 << 20, **options})
        engines.append(llm)
        return llm

    yield make
    for llm in engines:
        llm.shutdown()


def test_an_extension_with_a_keyword_only_new_builds_workers(make_llm, checkpoints) -> None:
    llm = make_llm(checkpoints[0], worker_extension_cls=f"{HERE}.KeywordNewExtension")
    assert llm.collective_rpc("rank_of") == [0]


def test_an_extension_may_not_shadow_the_worker_through_its_bases(make_llm, checkpoints) -> None:
    with pytest.raises(WorkerExtensionError, match="sleep"):
        make_llm(checkpoints[0], worker_extension_cls=f"{HERE}.InheritedConflictExtension")


def _trainer(port: int, seeds: list[int], conn: Connection) -> None:
    """Rank 0, as slime drives it: one broadcast of ``hf_state_dict(seed)`` per update call,
    each followed by the engine's word that the call returned."""
    group = create_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=60)
    weights = list(hf_state_dict(seeds[0]).items())
    conn.send([(name, str(t.dtype), list(t.shape)) for name, t in weights])
    for seed in seeds:
        broadcast_weights(group, list(hf_state_dict(seed).items()), timeout_s=60)
        conn.recv()


def test_a_refit_refused_while_asleep_keeps_the_group_in_step(make_llm, checkpoints) -> None:
    """The weights asleep refuse ``update_weights_from_distributed``; the trainer's broadcast
    for that call must be drained with it, or the next call loads that broadcast's tensors."""
    reference = make_llm(checkpoints[1])
    expected = tokens(reference.generate(PROMPTS, GREEDY))
    reference.shutdown()
    llm = make_llm(checkpoints[0])
    port = free_port()
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    trainer = context.Process(target=_trainer, args=(port, [3, 2], child), daemon=True)
    trainer.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")
        names, dtypes, shapes = zip(*conn.recv(), strict=True)
        llm.sleep(level=2)
        with pytest.raises(EngineAsleepError, match="wake_up") as error:
            llm.update_weights_from_distributed(names, dtypes, shapes, GROUP)  # seed 3's
        assert f"weight-update group '{GROUP}' is in step" in str(error.value)
        conn.send(None)
        llm.wake_up(["weights"])
        llm.update_weights_from_distributed(names, dtypes, shapes, GROUP, weight_version="2")
        conn.send(None)
        llm.wake_up(["kv_cache"])
        assert tokens(llm.generate(PROMPTS, GREEDY)) == expected  # seed 2's, not seed 3's
        llm.destroy_weights_update_group(GROUP)
    finally:
        trainer.join(timeout=10)
        if trainer.is_alive():
            trainer.kill()


def test_a_refit_failing_midway_refuses_generation_and_keeps_the_group_in_step(
    make_llm, checkpoints, monkeypatch
) -> None:
    """A write that fails partway leaves the weights mixed: generating is refused with a typed
    error that says to refit, and the rest of the trainer's broadcast was received, so the next
    refit over the same group loads its own tensors (seed 2's), not the failed one's."""
    reference = make_llm(checkpoints[1])
    expected = tokens(reference.generate(PROMPTS, GREEDY))
    reference.shutdown()
    llm = make_llm(checkpoints[0])
    port = free_port()
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    trainer = context.Process(target=_trainer, args=(port, [3, 2], child), daemon=True)
    trainer.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")
        names, dtypes, shapes = zip(*conn.recv(), strict=True)
        monkeypatch.setattr(weight_io, "load_weights", failing_write(after=5))
        with pytest.raises(WeightTransferError, match="the group is in step"):
            llm.update_weights_from_distributed(names, dtypes, shapes, GROUP)  # seed 3's
        monkeypatch.undo()
        conn.send(None)
        with pytest.raises(WeightsNotLoadedError, match="a refit failed partway"):
            llm.generate(PROMPTS, GREEDY)
        llm.update_weights_from_distributed(names, dtypes, shapes, GROUP)
        conn.send(None)
        assert tokens(llm.generate(PROMPTS, GREEDY)) == expected  # seed 2's, not seed 3's
        llm.destroy_weights_update_group(GROUP)
    finally:
        trainer.join(timeout=10)
        if trainer.is_alive():
            trainer.kill()
