"""Runs the fault-injection cases of test_fault_injection.py, each in a forked child process.

``python -m tests.memory.fault_runner [METHOD ...]`` first runs the scenario once without a fault
to count the calls of every method in ``faults.COUNTED``, then, for each method and each k from 1
to its count, runs the scenario with the k-th call failing. A call made by a sleep is tried in two
variants: ``retry`` repeats the failed sleep first, ``wake`` wakes everything first; a call made by
a wake in one (``wake``: the wake is repeated); a call made by a free is not raised (the block
dies in a deleter): the allocation waits, truthfully described, for the next call to retry it.
Each case runs in its own forked child, so a
segfault is that case's failure and never the runner's. One JSON line per case goes to stdout:
``{"case", "method", "k", "variant", "outcome", "detail"}`` with outcome ``ok``, ``failed`` (an
assertion, with its traceback) or ``crashed`` (a signal). The first line is
``{"phases": {method: [the step kind of each call]}, "dry_run", "detail"}``.

The scenario (``Scenario.run``): weights HOST at level 1 in several allocations (two of their own
and slabs of small blocks, under a trimming slab rule, so every sleep also trims), kv_cache
DISCARD, runtime HOST, a user tag, and cuda_graph's many small blocks coalesced into a few
growing slabs (pool.py; SLAB_GROWTH is set to 1 here, so that a handful of blocks already grow
a slab); the arena prepared in the background for weights and cuda_graph (its pins can fail too;
the next sleep then grows the arena itself); level 1, wake,
a free of a weights allocation and of a whole cuda_graph slab (their tensors die), level 2, wake
(then refit), ``sleep(tags=...)``, a wake of one tag, a wake of the rest. Hashes go
in groups of 64 KiB here, so a sleep hashes several groups. Poison mode is on, so the wake fills
are exercised. After every step, and after every failure, ``check_truth`` compares
the manager's records with what the host backend has; after every wake each awake tensor is read
and every tensor whose contents were preserved must be bit-exact; at the end everything is freed
and the backend must be back at no handle, no mapping, no reservation and no pinned chunk.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from dormant.memory import (
    DriverError,
    MemoryManager,
    Policy,
    SleepFailedError,
    TagState,
    WakeFailedError,
    offload,
    pool,
)
from dormant.memory.host_backend import HostBackend
from dormant.memory.policy import sleep_request
from dormant.memory.slab_rules import SlabRule
from tests.memory.faults import COUNTED, FaultyBackend, check_truth

KiB = 1 << 10
VARIANTS = ("retry", "wake")
SLEEP, WAKE, PREPARE, FREE = "sleep", "wake", "prepare", "free"
# Small sizes on a 64 KiB granularity: every case is milliseconds. Blocks below 64 KiB share slabs.
SIZES = {
    "weights": [100 * KiB, 200 * KiB] + [1000 + 2500 * i for i in range(8)],  # 2 own, 2 slabs
    "kv_cache": [100 * KiB, 100 * KiB],
    "runtime": [4 * KiB, 300, 8 * KiB, 64, 2 * KiB],
    "adapter": [50 * KiB],
    "cuda_graph": [20 * KiB] * 10,  # slabs of 64, 64 and 128 KiB (3, 3 and 4 blocks)
}
STEPS: list[tuple[str, Mapping[str, Any]]] = [
    (PREPARE, {"tags": {"weights": "host", "cuda_graph": "host"}}),
    (SLEEP, {"level": 1}),
    (WAKE, {}),
    (FREE, {"weights": [0], "cuda_graph": [0, 1, 2]}),  # an own allocation; the first slab
    (SLEEP, {"level": 2}),
    (WAKE, {}),
    (SLEEP, {"tags": {"weights": "host", "kv_cache": "discard", "adapter": "discard"}}),
    (WAKE, {"tags": ["weights"]}),
    (WAKE, {}),
]


def expected_bytes() -> dict[str, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return {
        tag: [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes]
        for tag, sizes in SIZES.items()
    }


class Scenario:
    """One manager over a FaultyBackend, its tensors, and which of them hold their data."""

    def __init__(self, expected: dict[str, list[torch.Tensor]]) -> None:
        self.backend = FaultyBackend(HostBackend(granularity=64 * KiB))
        self.mm = MemoryManager(
            self.backend,
            poison=True,
            slab_bytes=64 * KiB,
            max_slab_bytes=1 << 20,
            slab_rules={"weights": SlabRule(max_slab_bytes=1 << 20, trims=True)},
            arena_chunk_bytes=128 * KiB,
        )
        self.mm.register_tag("adapter", levels={1: "host", 2: "host"})
        self.expected = {tag: list(tensors) for tag, tensors in expected.items()}
        self.stale = {"kv_cache"}  # tags whose contents may have been dropped: never promised
        self.tensors = {
            t: [self.mm.empty((n,), torch.uint8, t) for n in s] for t, s in SIZES.items()
        }
        for tag in self.tensors:
            self.refit(tag)

    def refit(self, tag: str) -> None:
        """Writes the expected bytes in place (what an engine does after a discard)."""
        for tensor, data in zip(self.tensors[tag], self.expected[tag], strict=True):
            tensor.copy_(data)

    def run(self, variant: str) -> None:
        for kind, arguments in STEPS:
            self.backend.phase = kind
            if kind == SLEEP:
                self.sleep(arguments, variant)
            elif kind == PREPARE:
                self.prepare(arguments)
            elif kind == FREE:
                self.free(arguments)
            else:
                self.wake(arguments)
            check_truth(self.mm, self.backend)
        assert self.backend.is_spent, "the armed failure never fired"
        self.backend.disarm()
        assert not self.mm.is_sleeping()
        self.close()

    def sleep(self, arguments: Mapping[str, Any], variant: str) -> None:
        request = self.request(arguments)
        discarding = {t for t, p in request.items() if p is Policy.DISCARD}
        self.stale |= discarding  # even a sleep that fails may have dropped some of them
        try:
            self.mm.sleep(**arguments)
        except SleepFailedError as error:
            self.after_failure(error, "sleep")
            if variant == "wake":
                self.wake({})
                self.stale |= discarding
            self.mm.sleep(**arguments)  # must complete now
        states = self.mm.tag_states()
        want = {Policy.HOST: TagState.OFFLOADED, Policy.DISCARD: TagState.DISCARDED}
        for tag, policy in request.items():
            asleep = want.get(policy, TagState.AWAKE) if tag in self.tensors else TagState.AWAKE
            assert states[tag] is asleep, (tag, states[tag])

    def prepare(self, arguments: Mapping[str, Any]) -> None:
        """Prepares the arena in one background thread (so that the calls count in order)."""
        preparation = self.mm.prepare_arena(**arguments, num_threads=1)
        try:
            preparation.wait()
        except DriverError as error:
            self.after_failure(error, "prepare")
            assert preparation.nbytes and self.mm.arena.capacity_bytes == 0, "a partial arena"

    def free(self, arguments: Mapping[str, list[int]]) -> None:
        """Lets the tensors at these indices die; a free that fails waits for the next call."""
        dying = len(self.mm._table.dying)
        for tag, indices in arguments.items():
            for i in sorted(indices, reverse=True):
                del self.tensors[tag][i], self.expected[tag][i]
        gc.collect()
        failed = self.failed_in(FREE)
        assert len(self.mm._table.dying) == dying + failed, "a failed free was not kept"

    def failed_in(self, phase: str) -> bool:
        """Whether the armed failure fired in a call of ``phase``."""
        armed = self.backend.armed
        if armed is None or not self.backend.is_spent:
            return False
        method, k = armed
        return self.backend.phases[method][k - 1] == phase

    def wake(self, arguments: Mapping[str, Any]) -> None:
        before = self.mm.tag_states()
        try:
            self.mm.wake_up(**arguments)
        except WakeFailedError as error:
            self.after_failure(error, "wake")
            assert self.mm.tag_states() == before, "a failed wake changed a state"
            self.mm.wake_up(**arguments)
        states = self.mm.tag_states()
        woken = arguments.get("tags") or list(states)
        assert all(states[t] is TagState.AWAKE for t in woken), states
        self.verify_awake()

    def after_failure(self, error: Exception, what: str) -> None:
        assert self.backend.is_spent, f"{what} failed without the injected failure: {error}"
        assert "injected failure" in str(error), str(error)
        check_truth(self.mm, self.backend)

    def verify_awake(self) -> None:
        """Reads every tensor of every AWAKE tag; the preserved ones must be bit-exact, the
        others are refit."""
        for tag, state in self.mm.tag_states().items():
            if state is not TagState.AWAKE or tag not in self.tensors:
                continue
            for tensor, data in zip(self.tensors[tag], self.expected[tag], strict=True):
                is_equal = torch.equal(tensor, data)  # reads every byte
                assert is_equal or tag in self.stale, f"{tag}: preserved bytes changed"
            if tag in self.stale:
                self.refit(tag)
                self.stale.discard(tag)

    def request(self, arguments: Mapping[str, Any]) -> dict[str, Policy]:
        return sleep_request(arguments.get("level"), arguments.get("tags"), self.mm._user_tags)

    def close(self) -> None:
        self.tensors.clear()
        gc.collect()
        self.mm.close()
        host = self.backend.inner
        assert host.live_handles() == {}, f"leaked handles {host.live_handles()}"
        assert host.mapped_ranges() == {}, "leaked mappings"
        assert host.live_reservations() == {}, "leaked VA reservations"
        assert self.backend.num_pinned == 0, "leaked arena chunks"
        assert self.mm.arena.capacity_bytes == 0


def run_case(
    expected: dict[str, list[torch.Tensor]], method: str | None, k: int, variant: str
) -> dict[str, list[str]]:
    """Runs the scenario with the ``k``-th call of ``method`` failing (None: no failure); returns
    the phase of every call counted during its steps, by method."""
    scenario = Scenario(expected)
    scenario.backend.arm(method, k)
    phases = scenario.backend.phases
    scenario.run(variant)
    return {m: list(p) for m, p in phases.items()}


def start_child(work: Callable[[], dict[str, list[str]]]) -> tuple[int, int]:
    """Forks a child that runs ``work`` (one case) and writes its outcome to a pipe; returns
    (pid, the pipe's read end). The outcome is small enough for the pipe's buffer."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            result = {"outcome": "ok", "detail": "", "phases": work()}
        except BaseException:
            result = {"outcome": "failed", "detail": traceback.format_exc()[-8000:], "phases": {}}
        with os.fdopen(write_end, "w") as pipe:
            json.dump(result, pipe)
        os._exit(0)
    os.close(write_end)
    return pid, read_end


def finish_child(read_end: int, status: int) -> dict[str, Any]:
    """The outcome of a child that exited with ``status``: a signal is a crash."""
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    if os.WIFSIGNALED(status):
        signal = os.WTERMSIG(status)
        return {"outcome": "crashed", "detail": f"killed by signal {signal}", "phases": {}}
    if not text:
        return {"outcome": "crashed", "detail": f"exit status {status}, no result", "phases": {}}
    return dict(json.loads(text))


def main(methods: list[str]) -> int:
    torch.set_num_threads(1)  # forked children must not inherit a thread pool
    pool.SLAB_GROWTH = 1  # every new slab as large as the tag's slabs together
    offload.HASH_GROUP_MIN_BYTES = 64 * KiB
    expected = expected_bytes()
    gc.freeze()  # the children's collections then skip everything imported here (torch's heap)
    pid, read_end = start_child(partial(run_case, expected, None, 0, "retry"))
    dry = finish_child(read_end, os.waitpid(pid, 0)[1])
    print(json.dumps({"phases": dry["phases"], "dry_run": dry["outcome"], "detail": dry["detail"]}))
    if dry["outcome"] != "ok":
        return 1
    cases = [
        (method, k, variant)
        for method in methods or list(COUNTED)
        for k, phase in enumerate(dry["phases"].get(method, []), start=1)
        for variant in (VARIANTS if phase == SLEEP else ("wake",))
    ]
    running: dict[int, tuple[int, tuple[str, int, str]]] = {}
    jobs = os.cpu_count() or 1
    while cases or running:
        if cases and len(running) < jobs:
            case = cases.pop(0)
            pid, read_end = start_child(partial(run_case, expected, *case))
            running[pid] = (read_end, case)
            continue
        pid, status = os.wait()
        read_end, (method, k, variant) = running.pop(pid)
        result = finish_child(read_end, status)
        line = {"case": f"{method}#{k}/{variant}", "method": method, "k": k, "variant": variant}
        print(json.dumps(line | {"outcome": result["outcome"], "detail": result["detail"]}))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
