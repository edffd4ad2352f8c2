"""The communicator's sleep bookkeeping (issue 20), over gloo on the CPU: ``recreate`` destroys
a TP subgroup's process group and makes a new one on the same ranks, installed in the same
``DistributedTPGroup`` the layers hold, so collectives work after every cycle; ``suspend`` calls
the NCCL binding once per release and restore, on every rank; what cannot work is refused with
``CommSleepError`` before anything changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dormant.distributed.comm_sleep import (
    CommSleepError,
    CommSleepMode,
    CommunicatorSleep,
    NcclSuspendApi,
)
from dormant.distributed.communicator import NCCL_OWNER, create_communicator
from dormant.distributed.parallel_state import DistributedTPGroup, SingleRankGroup

WORLD = 2


class FakeSuspendApi(NcclSuspendApi):
    """Records the groups it was asked to suspend and resume."""

    def __init__(self) -> None:  # no library
        self.calls: list[tuple[str, int]] = []

    def suspend(self, group: DistributedTPGroup) -> None:
        self.calls.append(("suspend", group.rank))

    def resume(self, group: DistributedTPGroup) -> None:
        self.calls.append(("resume", group.rank))


class FakeLedger:
    """Records what the residual ledger is told."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mark(self, label: str, owner: str | None = None) -> None:
        self.calls.append(("mark", label, owner))

    def returned(self, owner: str, nbytes: int | None) -> None:
        self.calls.append(("returned", owner, nbytes))


def _summed(group: DistributedTPGroup) -> float:
    tensor = torch.tensor([float(group.rank + 1)])
    return float(group.all_reduce(tensor).item())


def _rank_main(rank: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        group = DistributedTPGroup(dist.new_group(list(range(WORLD))))
        sleeper = CommunicatorSleep(group, CommSleepMode.RECREATE)
        sums, actions, old = [_summed(group)], [], group.process_group
        for _ in range(2):
            actions.append(sleeper.release().action)
            with pytest.raises(CommSleepError, match="released already"):
                sleeper.release()
            actions.append(sleeper.restore().action)
            sums.append(_summed(group))
        fake, ledger = FakeSuspendApi(), FakeLedger()
        made = create_communicator(group, ledger)  # type: ignore[arg-type]  # gloo: nothing made
        suspender = CommunicatorSleep(group, "suspend", api=fake, ledger=ledger)  # type: ignore[arg-type]
        suspender.release(), suspender.restore(), suspender.restore()  # the last does nothing
        refusals = []
        for mode, kwargs in (("recreate", {}), ("recreate", {"captures_collectives": True})):
            target = DistributedTPGroup() if not kwargs else group
            try:
                CommunicatorSleep(target, mode, **kwargs)
            except CommSleepError as error:
                refusals.append(str(error))
        results[rank] = {
            "sums": sums,
            "actions": actions,
            "replaced": group.process_group is not old,
            "ranks": group.ranks,
            "suspend_calls": fake.calls,
            "ledger": (made, ledger.calls),
            "refusals": refusals,
        }
    finally:
        dist.destroy_process_group()


def test_recreate_and_suspend_cycles_over_gloo(tmp_path: Path) -> None:
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    init_file = str(tmp_path / "init")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(
        _rank_main, args=(init_file, results), nprocs=WORLD, start_method="spawn", join=True
    )
    for rank in range(WORLD):
        report = results[rank]
        assert report["sums"] == [3.0, 3.0, 3.0]  # 1 + 2, before and after each cycle
        assert report["actions"] == ["destroyed", "recreated"] * 2
        assert report["replaced"] and report["ranks"] == [0, 1]
        assert report["suspend_calls"] == [("suspend", rank), ("resume", rank)]
        # told of each release and restore (unmeasured off the GPU); no communicator on gloo
        assert report["ledger"] == (False, [("returned", NCCL_OWNER, None)] * 2)
        world_refusal, graphs_refusal = report["refusals"]
        assert "subgroup" in world_refusal and "CUDA graphs" in graphs_refusal


def test_a_single_rank_or_off_releases_nothing() -> None:
    for sleeper in (
        CommunicatorSleep(SingleRankGroup(), "recreate"),
        CommunicatorSleep(SingleRankGroup(), "off"),
    ):
        assert not sleeper.is_active
        report = sleeper.release()
        assert report.action == "none" and report.freed_bytes is None
        assert sleeper.restore().action == "none"


def test_suspend_without_nccl_says_why() -> None:
    if not torch.cuda.is_available():
        assert "no NCCL" in (NcclSuspendApi.unavailable_reason() or "")
        with pytest.raises(CommSleepError, match="unavailable"):
            NcclSuspendApi.load()
    with pytest.raises(ValueError):
        CommSleepMode("pause")


def test_an_engine_at_tp2_recreates_its_group_across_sleeps(tmp_path: Path) -> None:
    """``LLM(..., tensor_parallel_size=2, comm_sleep="recreate")`` over gloo: a full sleep
    destroys each rank's TP process group and the wake makes it again; the tokens after each
    cycle equal those before. A partial sleep leaves the communicator alone."""
    from dormant import LLM
    from tests.engine.conftest import GREEDY, PROMPTS, write_checkpoint

    def released(worker) -> tuple[bool, int]:
        group = worker.comm_sleep.group.process_group
        # Kept alive on the worker, so that a new group cannot take a freed one's id
        worker.seen_groups = [*getattr(worker, "seen_groups", []), group]
        return worker.comm_sleep.released, id(group)

    path = write_checkpoint(tmp_path / "ckpt", seed=1)
    options = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)
    with LLM(str(path), tensor_parallel_size=2, comm_sleep="recreate", **options) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        groups = [g for _, g in llm.collective_rpc(released)]
        for level in (1, 2):
            llm.sleep(level=level)
            assert [r for r, _ in llm.collective_rpc(released)] == [True, True]
            llm.wake_up()
            if level == 2:
                llm.reload_weights()
            state = llm.collective_rpc(released)
            assert [r for r, _ in state] == [False, False]
            assert all(g != old for (_, g), old in zip(state, groups, strict=True))
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        llm.llm_engine.release(["kv_cache"])  # a partial sleep
        assert [r for r, _ in llm.collective_rpc(released)] == [False, False]
        llm.wake_up()


def test_an_engine_refuses_suspend_without_nccl_before_it_starts(tmp_path: Path) -> None:
    from dormant import LLM
    from tests.engine.conftest import write_checkpoint

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without NCCL")
    path = write_checkpoint(tmp_path / "ckpt", seed=1)
    with pytest.raises(CommSleepError, match="unavailable"):
        LLM(str(path), device="cpu", tensor_parallel_size=2, comm_sleep="suspend",
            max_model_len=256, kv_cache_memory_bytes=4 << 20)  # fmt: skip
    with pytest.raises(Exception, match="comm_sleep"):
        LLM(str(path), device="cpu", comm_sleep="pause", max_model_len=256)
