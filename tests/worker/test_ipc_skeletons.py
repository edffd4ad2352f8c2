"""Flattened buckets found again by their bytes (``dormant/worker/ipc_skeletons.py``) on the CPU,
pickled as a trainer's CUDA buckets are (``test_ipc_receiver.send``: torch's 15 rebuild
arguments, a new counter slot and event per share)."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from dormant.worker import ipc_skeletons
from dormant.worker.ipc_payload import (
    FlattenedTensorMetadata,
    deserialize_payload,
    unpickle_entry,
)
from dormant.worker.ipc_skeletons import PayloadSkeletons
from dormant.worker.ipc_weights import bucket_items, pack_flattened_bucket
from dormant.worker.transfer_errors import WeightTransferError
from tests.worker.test_ipc_receiver import FakeDriver, SharedBuffer, send


@pytest.fixture
def driver(tmp_path: Path) -> FakeDriver:
    d = FakeDriver(tmp_path)
    d.buffers[b"buf"] = np.zeros(1 << 16, dtype=np.uint8)
    return d


def bucket(seed: int, names: tuple[str, ...] = ("a", "b", "c")) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(4, 8 + i, generator=generator).bfloat16()) for i, n in enumerate(names)]


def read(skeletons: PayloadSkeletons, handles, entry: bytes):
    flat, layout = skeletons.read(entry, handles.rebuild_cuda_tensor)
    handles.end_payload()
    return flat, layout


def test_a_bucket_sent_again_reuses_its_layout_and_rebuilds_its_tensor(driver) -> None:
    skeletons, handles = PayloadSkeletons(), driver.handles()
    first = send(driver, b"buf", bucket(1), b"e1")
    _, layout = read(skeletons, handles, first)
    assert (skeletons.num_hits, skeletons.num_misses) == (0, 1)
    expected = bucket_items(deserialize_payload(first, handles.rebuild_cuda_tensor))
    assert layout == expected[1]
    for seed in (2, 3):  # new values, the same layout: a new slot and event each time
        entry = send(driver, b"buf", bucket(seed), b"e%d" % seed)
        again, kept = read(skeletons, handles, entry)
        assert kept is layout and torch.equal(again, expected[0])  # the new bytes, in place
        assert torch.equal(
            again[: kept[0].nbytes], bucket(seed)[0][1].reshape(-1).view(torch.uint8)
        )
    assert (skeletons.num_hits, skeletons.num_misses) == (2, 1)
    # every read rebuilt its tensor once: one counter released per held share
    assert handles.num_reused == 3 and handles.counters.num_released == 3
    assert driver.waits[-2:] == [(0, b"e2"), (0, b"e3")]


def test_another_layout_is_read_in_full(driver) -> None:
    skeletons, handles = PayloadSkeletons(), driver.handles()
    _, first = read(skeletons, handles, send(driver, b"buf", bucket(1), b"e"))
    _, renamed = read(skeletons, handles, send(driver, b"buf", bucket(1, ("a", "x", "c")), b"e"))
    _, shorter = read(skeletons, handles, send(driver, b"buf", bucket(1, ("a", "b")), b"e"))
    assert [i.name for i in renamed] == ["a", "x", "c"] and len(shorter) == 2
    assert skeletons.num_misses == 3 and skeletons.num_hits == 0
    _, again = read(skeletons, handles, send(driver, b"buf", bucket(4), b"e"))
    assert again is first and skeletons.num_hits == 1


def element_bucket(driver: FakeDriver, dtype: torch.dtype, event: bytes) -> bytes:
    """SGLang's older bucket: a ``dtype`` buffer, element offsets, every item of its dtype, so
    the items' dtype is the pickle's reference to the buffer's (its argument tuple's memo)."""
    flat = torch.from_numpy(driver.buffers[b"buf"]).view(dtype)[:96]
    metadata = [
        FlattenedTensorMetadata(n, torch.Size([4, 8]), dtype, 32 * i, 32 * (i + 1), 32)
        for i, n in enumerate("abc")
    ]
    stream = io.BytesIO()
    shared = SharedBuffer(b"buf", flat, event, driver.share())
    pickle.Pickler(stream, protocol=4).dump({"flattened_tensor": shared, "metadata": metadata})
    return stream.getvalue()


def test_equal_bytes_that_mean_another_dtype_are_read_in_full(driver) -> None:
    """The same bytes outside the arguments, but the items' dtype refers to the buffer's, which
    changed: the kept layout must not be used."""
    skeletons, handles = PayloadSkeletons(), driver.handles()
    as_float = element_bucket(driver, torch.float32, b"e1")
    as_int = element_bucket(driver, torch.int32, b"e2")
    split = ipc_skeletons._split(as_float)
    other = ipc_skeletons._split(as_int)
    assert split and other and as_float[split[2] :] == as_int[other[2] :]  # the same rest
    assert as_float[split[0] : split[1]] == as_int[other[0] : other[1]]
    _, floats = read(skeletons, handles, as_float)
    _, ints = read(skeletons, handles, as_int)
    assert {i.dtype for i in floats} == {torch.float32} and {i.dtype for i in ints} == {torch.int32}
    assert skeletons.num_hits == 0 and skeletons.num_misses == 2
    assert handles.num_opened + handles.num_reused == 2  # one rebuild each, none repeated
    assert read(skeletons, handles, element_bucket(driver, torch.int32, b"e3"))[1] is ints


def test_a_corrupted_argument_tuple_raises_a_typed_error_and_holds_nothing(driver) -> None:
    skeletons, handles = PayloadSkeletons(), driver.handles()
    good = send(driver, b"buf", bucket(1), b"e")
    read(skeletons, handles, good)
    _, args, end = ipc_skeletons._split(good)  # type: ignore[misc]
    corrupted = good[:args] + b"K\x01" + good[end - 4 :]  # a one-item argument tuple
    with pytest.raises(WeightTransferError, match="could not rebuild"):
        skeletons.read(corrupted, handles.rebuild_cuda_tensor)
    handles.end_payload()
    assert handles.num_held == 0 and handles.counters.num_released == 0


def test_metadata_as_dicts_or_another_format_is_read_in_full_and_not_kept(driver) -> None:
    skeletons, handles = PayloadSkeletons(), driver.handles()
    payload = {
        "flattened_tensor": SharedBuffer(b"buf", torch.from_numpy(driver.buffers[b"buf"]), b"e", 0),
        "metadata": [dict(name="a", shape=[4, 8], dtype=torch.bfloat16, start_idx=0,
                          end_idx=64, numel=64)],
    }  # fmt: skip
    for _ in range(2):
        payload["flattened_tensor"].slot = driver.share()
        _, layout = read(skeletons, handles, pickle.dumps(payload, protocol=4))
        assert [i.name for i in layout] == ["a"]
    assert skeletons.num_misses == 2 and skeletons.num_hits == 0
    named = [("a", SharedBuffer(b"buf", torch.from_numpy(driver.buffers[b"buf"]), b"e", 1))]
    with pytest.raises(WeightTransferError, match="must be a dict"):
        skeletons.read(pickle.dumps(named, protocol=4), handles.rebuild_cuda_tensor)


def test_at_most_max_skeletons_are_kept(driver, monkeypatch) -> None:
    monkeypatch.setattr(ipc_skeletons, "MAX_SKELETONS", 2)
    skeletons, handles = PayloadSkeletons(), driver.handles()

    def again(name: str, seed: int = 2) -> None:
        read(skeletons, handles, send(driver, b"buf", bucket(seed, (name,)), b"e"))

    for name in "xyz":
        again(name, 1)
    again("z")
    assert (skeletons.num_hits, skeletons.num_misses) == (1, 3)
    again("x")  # the oldest went when z was kept
    assert (skeletons.num_hits, skeletons.num_misses) == (1, 4)


def test_a_kept_layout_is_checked_against_each_buffers_length(driver) -> None:
    skeletons, handles = PayloadSkeletons(), driver.handles()
    full = element_bucket(driver, torch.float32, b"e1")
    read(skeletons, handles, full)
    short = full.replace(b"K`", b"K\x10", 1)  # the buffer's 96 elements (BININT1 96) as 16
    assert ipc_skeletons._split(short)[2:] == ipc_skeletons._split(full)[2:]  # type: ignore[index]
    with pytest.raises(WeightTransferError, match="does not hold"):
        skeletons.read(short, handles.rebuild_cuda_tensor)
    assert skeletons.num_hits == 0 and skeletons.num_misses == 1  # found, but it did not fit


def test_the_framed_head_unpickles_to_what_the_unframed_one_does(driver) -> None:
    """A hit unpickles the head in one FRAME (read from the file at once); the tensor it
    rebuilds and the memo it leaves, which the kept layout is matched against, are the same."""
    entry = send(driver, b"buf", bucket(1), b"e")
    body, _, end = ipc_skeletons._split(entry)  # type: ignore[misc]
    plain = entry[:2] + entry[body:end] + b"."
    framed = ipc_skeletons._framed(entry[:2], entry[body:end] + b".")
    assert framed[2] == 0x95 and int.from_bytes(framed[3:11], "little") == len(plain) - 2
    (a, memo_a), (b, memo_b) = (
        unpickle_entry(raw, driver.handles().rebuild_cuda_tensor) for raw in (plain, framed)
    )
    assert torch.equal(a, b) and a.data_ptr() == b.data_ptr()
    assert list(memo_a) == list(memo_b)
    assert all(type(memo_a[k]) is type(memo_b[k]) for k in memo_a)


def test_a_head_past_the_first_frame_is_read_in_full_every_time(driver) -> None:
    """The metadata pickled before the tensor, over 64 KiB: the pickler starts a new FRAME
    inside the head, which a kept layout's one-frame head cannot hold (the second read failed
    with "pickle data was truncated"). Such a bucket is not kept, and every read succeeds."""
    driver.buffers[b"big"] = np.zeros(1 << 20, dtype=np.uint8)
    names = tuple(f"model.layers.{i}.mlp.experts.{i}.down_proj.weight" for i in range(1500))
    skeletons, handles, layouts = PayloadSkeletons(), driver.handles(), []
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        named = [(name, torch.randn(2, 2, generator=generator).bfloat16()) for name in names]
        buffer = torch.from_numpy(driver.buffers[b"big"])
        payload = pack_flattened_bucket(buffer, named)
        shared = SharedBuffer(b"big", payload["flattened_tensor"], b"e", driver.share())
        stream = io.BytesIO()
        pickle.Pickler(stream, protocol=4).dump(
            {"metadata": payload["metadata"], "flattened_tensor": shared}
        )
        flat, layout = read(skeletons, handles, stream.getvalue())
        assert torch.equal(flat, buffer[: flat.numel()])
        layouts.append(layout)
    assert (skeletons.num_hits, skeletons.num_misses) == (0, 2)
    assert layouts[0] == layouts[1] and len(layouts[0]) == len(names)
