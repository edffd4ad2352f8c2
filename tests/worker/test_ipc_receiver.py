"""The receiver's held handles (``dormant/worker/ipc_receiver.py``) on the CPU.

The payloads are pickled as a trainer's CUDA tensors are: ``rebuild_cuda_tensor`` with torch's
15 arguments, resolved by the restricted unpickler to ``IpcHandles``. The "driver" is faked:
opening a handle maps the sender's buffer (a NumPy array) as a new storage, registered weakly, so
a storage stays open exactly as long as someone holds it; the sender writes into the same buffer
between buckets, as a reusing trainer does, and takes a ref-counter slot in a real file per
share, which the receiver must release once for every share it did not open.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.multiprocessing import reductions

from dormant.core.commands import Command
from dormant.core.errors import UnsupportedOptionError
from dormant.models import WeightError
from dormant.worker.draft_model import DraftModel, PrefixedObserver
from dormant.worker.ipc_counters import FILE_BYTES, HEADER_BYTES, RefCounterFiles
from dormant.worker.ipc_handles import IpcHandles
from dormant.worker.ipc_receiver import IPC_REFIT_COMMANDS, IpcReceiver
from dormant.worker.ipc_weights import FLATTENED_BUCKET, iter_buckets, pack_flattened_bucket
from dormant.worker.refit_record import RefitRecord
from dormant.worker.worker import Worker
from tests.worker.test_copy_plan import (
    TINY_LLAMA,
    assert_state_equal,
    expected_state,
    new_weights,
    state,
    tiny,
)


class FakeDriver:
    """Sender buffers by handle, and the sender's ref-counter file (a real file, as torch's in
    /dev/shm). ``open_storage`` stands in for ``_new_shared_cuda``: it maps a buffer as a fresh
    storage over the same memory, registered weakly, so a storage is open exactly as long as
    someone holds it, and records the counter it keeps (torch's deleter releases it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.buffers: dict[bytes, np.ndarray] = {}
        self.opened: dict[Any, reductions.StorageWeakRef] = {}
        self.waits: list[tuple[int, bytes]] = []  # the receiver's own waits (held handles)
        self.kept: list[int] = []  # the counter slot each open kept
        (root / COUNTERS[1:].decode()).write_bytes(bytes(FILE_BYTES))
        self.slots = np.memmap(root / COUNTERS[1:].decode(), np.int64, "r+", HEADER_BYTES)
        self.num_shared = 0

    def share(self) -> int:
        """A new counter slot, set to 1, as each ``reduce_tensor`` takes one."""
        slot, self.num_shared = self.num_shared, self.num_shared + 1
        self.slots[slot] = 1
        return slot

    def open_storage(self, device: int, handle: bytes, nbytes: int, offset: int, counter: bytes,
                     slot: int, event: bytes, sync: bool) -> torch.UntypedStorage:  # fmt: skip
        assert counter == COUNTERS and nbytes == self.buffers[handle].nbytes
        self.kept.append(slot)
        storage = torch.from_numpy(self.buffers[handle]).untyped_storage()
        self.opened[(handle, offset)] = reductions.StorageWeakRef(storage)
        return storage

    def is_open(self, handle: bytes) -> bool:
        ref = self.opened.get((handle, 0))
        return ref is not None and not ref.expired()

    def handles(self) -> IpcHandles:
        def unexpected(*args: Any) -> Tensor:
            raise AssertionError("torch's rebuild_cuda_tensor was called")

        return IpcHandles(
            self.open_storage, RefCounterFiles(str(self.root)),
            lambda d, e: self.waits.append((d, e)), unexpected,
        )  # fmt: skip


COUNTERS = b"/torch_1_2_0"


class SharedBuffer:
    """Pickles as a trainer's CUDA tensor: ``rebuild_cuda_tensor`` and its 15 arguments."""

    def __init__(self, handle: bytes, tensor: Tensor, event: bytes, slot: int) -> None:
        self.handle, self.tensor, self.event, self.slot = handle, tensor, event, slot

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        t = self.tensor
        return reductions.rebuild_cuda_tensor, (
            Tensor, t.shape, t.stride(), t.storage_offset(), torch.UntypedStorage, t.dtype, 0,
            self.handle, t.untyped_storage().nbytes(), 0, False, COUNTERS, self.slot, self.event,
            True,
        )  # fmt: skip


def send(driver: FakeDriver, handle: bytes, bucket: list, event: bytes) -> bytes:
    """Packs ``bucket`` into the sender's buffer ``handle`` and serializes the request."""
    buffer = torch.from_numpy(driver.buffers[handle])
    payload = pack_flattened_bucket(buffer, bucket)
    shared = SharedBuffer(handle, payload["flattened_tensor"], event, driver.share())
    stream = io.BytesIO()
    pickle.Pickler(stream).dump({"flattened_tensor": shared, "metadata": payload["metadata"]})
    return stream.getvalue()


@pytest.fixture
def driver(tmp_path: Path) -> FakeDriver:
    d = FakeDriver(tmp_path)
    d.buffers[b"reused"] = np.zeros(1 << 20, dtype=np.uint8)
    d.buffers[b"other"] = np.zeros(1 << 20, dtype=np.uint8)
    return d


def buckets_of(named: list, num_bytes: int = 96 << 10) -> list:
    buckets = list(iter_buckets(named, num_bytes))
    assert len(buckets) >= 3
    return buckets


def test_a_reused_buffer_stays_open_and_its_event_is_waited_on(driver: FakeDriver) -> None:
    model = tiny(TINY_LLAMA)
    receiver = IpcReceiver(driver.handles())
    for refit, seed in enumerate((1, 2)):
        named = new_weights(model, seed)
        for index, bucket in enumerate(buckets_of(named)):
            entry = send(driver, b"reused", bucket, event=b"event%d" % index)
            receiver.update_weights_from_tensor(model, [entry], load_format=FLATTENED_BUCKET)
            assert driver.is_open(b"reused") and receiver.handles.num_held == 1
        assert_state_equal(state(model), expected_state(TINY_LLAMA, named))
        receiver.release()  # the refit ended
        assert not driver.is_open(b"reused")
        num_buckets = len(buckets_of(named))
        # opened once per refit; every later bucket reused it and waited on its own event
        assert receiver.handles.num_opened == refit + 1
        assert receiver.handles.num_reused == (refit + 1) * (num_buckets - 1)
        waited = [e for _, e in driver.waits[-(num_buckets - 1) :]]
        assert waited == [b"event%d" % i for i in range(1, num_buckets)]
        # every share's counter released once: by the receiver, or kept by the open storage
        released = [s for s in range(driver.num_shared) if s not in driver.kept]
        assert all(driver.slots[s] == 0 for s in released)
        assert len(released) == receiver.handles.num_reused
        assert all(driver.slots[s] == 1 for s in driver.kept)  # its deleter (torch's) releases
    assert receiver.plans.num_built == num_buckets  # one plan per bucket layout, kept


def test_only_the_last_payloads_storage_is_held(driver: FakeDriver) -> None:
    model = tiny(TINY_LLAMA)
    receiver = IpcReceiver(driver.handles())
    first, second, *_ = buckets_of(new_weights(model, 3))
    receiver.update_weights_from_tensor(
        model, [send(driver, b"reused", first, b"e")], load_format=FLATTENED_BUCKET
    )
    receiver.update_weights_from_tensor(
        model, [send(driver, b"other", second, b"e")], load_format=FLATTENED_BUCKET
    )
    assert not driver.is_open(b"reused") and driver.is_open(b"other")
    assert receiver.handles.num_opened == 2 and receiver.handles.num_reused == 0


@pytest.mark.parametrize("bad", ["names", "load_format"])
def test_an_error_releases_the_held_handles(driver: FakeDriver, bad: str) -> None:
    """A bucket that does not fit, or an unknown ``load_format`` (it raised before the release
    once): the handles held since the last bucket are closed, and nothing was written."""
    model = tiny(TINY_LLAMA)
    receiver = IpcReceiver(driver.handles())
    first, second, *_ = buckets_of(new_weights(model, 4))
    receiver.update_weights_from_tensor(
        model, [send(driver, b"reused", first, b"e")], load_format=FLATTENED_BUCKET
    )
    if bad == "names":
        second = [(name + "x", tensor) for name, tensor in second]
    error, load_format = {
        "names": (WeightError, FLATTENED_BUCKET),
        "load_format": (UnsupportedOptionError, "flattened"),
    }[bad]
    before = state(model)
    with pytest.raises(error):
        receiver.update_weights_from_tensor(
            model, [send(driver, b"reused", second, b"e")], load_format=load_format
        )
    assert not driver.is_open(b"reused") and receiver.handles.num_held == 0
    assert_state_equal(state(model), before)


@pytest.mark.parametrize("command", list(Command))
def test_the_worker_ends_the_ipc_refit_on_any_other_command(command: Command) -> None:
    calls: list[str] = []
    worker = SimpleNamespace(
        refitter=SimpleNamespace(end_ipc_refit=lambda: calls.append("end")),
        _handlers={command: lambda: calls.append("ran")},
    )
    Worker.handle(worker, command)  # type: ignore[arg-type]
    assert calls == (["ran"] if command in IPC_REFIT_COMMANDS else ["end", "ran"])


# ── speculative decoding's draft in the same buckets ───────────────────────────────────────


def target_and_draft() -> tuple[Any, DraftModel, RefitRecord]:
    """A target and a draft model sharing one record, as a worker's (``draft.`` names)."""
    target, draft = tiny(TINY_LLAMA), object.__new__(DraftModel)
    draft.model = tiny(TINY_LLAMA)
    record = RefitRecord((*target.expected_weight_shapes(), *draft.weight_names))
    target.weight_observer, draft.model.weight_observer = record, PrefixedObserver(record)
    record.discarded()  # as after a level-2 sleep
    return target, draft, record


def test_a_bucket_of_target_and_draft_names_refits_both_with_a_plan_per_model(
    driver: FakeDriver,
) -> None:
    target, draft, record = target_and_draft()
    driver.buffers[b"big"] = np.zeros(4 << 20, dtype=np.uint8)
    receiver = IpcReceiver(driver.handles())
    for seed in (1, 2):
        target_named, draft_named = new_weights(target, seed), new_weights(target, seed + 10)
        prefixed = [("draft." + n, t) for n, t in draft_named]
        bucket = [*prefixed[:3], *target_named, *prefixed[3:]]  # the names in any order
        entry = send(driver, b"big", bucket, b"e")
        written = receiver.update_weights_from_tensor(
            target, [entry], load_format=FLATTENED_BUCKET, draft=draft
        )
        assert written == record.names and not record.stale
        assert_state_equal(state(target), expected_state(TINY_LLAMA, target_named))
        assert_state_equal(state(draft.model), expected_state(TINY_LLAMA, draft_named))
    assert len(receiver.plans.of(target)) == len(receiver.plans.of(draft.model)) == 1
    assert receiver.plans.num_built == 2  # the second refit reused both plans


def test_a_bad_draft_name_in_a_bucket_is_refused_before_any_write(driver: FakeDriver) -> None:
    target, draft, record = target_and_draft()
    driver.buffers[b"big"] = np.zeros(4 << 20, dtype=np.uint8)
    receiver = IpcReceiver(driver.handles())
    before, draft_before = state(target), state(draft.model)
    named = new_weights(target, 5)
    bucket = [*named, *(("draft." + n, t) for n, t in named[:2]), ("draft.nope", named[0][1])]
    with pytest.raises(WeightError, match="nope"):
        receiver.update_weights_from_tensor(
            target, [send(driver, b"big", bucket, b"e")], load_format=FLATTENED_BUCKET,
            draft=draft,
        )  # fmt: skip
    assert_state_equal(state(target), before)
    assert_state_equal(state(draft.model), draft_before)
    assert record.stale == set(record.names)  # still all stale: nothing was written
    # without a draft, a draft. name is the target's unknown name
    with pytest.raises(WeightError, match=r"draft\.model\.embed_tokens\.weight"):
        receiver.update_weights_from_tensor(
            target, [send(driver, b"big", bucket[-3:-1], b"e")], load_format=FLATTENED_BUCKET
        )
