"""Weights sent as IPC handles by a second process (SGLang's update_weights_from_tensor formats).

On the CPU, ``reduce_tensor`` shares tensors through file descriptors, so a real sender process
(spawned) exercises the same serialize → send → rebuild → copy path as CUDA IPC on a GPU.
"""

from __future__ import annotations

import base64
import multiprocessing as mp
import os
import pickle
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from torch import Tensor

from dormant.core.errors import UnsupportedOptionError
from dormant.models import CausalLM, ModelConfig, WeightError, build_model
from dormant.worker.ipc_receiver import update_weights_from_tensor
from dormant.worker.ipc_weights import (
    FLATTENED_BUCKET,
    flattened_bucket_request,
    iter_buckets,
    make_flattened_bucket,
    serialize_for_update,
    unflatten_bucket,
)
from dormant.worker.refit_record import RefitRecord
from dormant.worker.transfer_errors import WeightTransferError

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "torch_dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip
Shapes = dict[str, tuple[int, ...]]


def tiny_model(device: str = "cpu") -> CausalLM:
    """A tiny fp32 Qwen3 with seeded weights and a refit record as its observer."""
    with torch.device(device):
        model = build_model(ModelConfig.from_dict(TINY_QWEN3))
    model.init_buffers()
    model.reset_kv_scales()
    model.init_random_weights(0)
    model.weight_observer = RefitRecord(model.expected_weight_shapes())
    return model


def new_weights(shapes: Shapes, seed: int, device: str = "cpu") -> list[tuple[str, Tensor]]:
    """Deterministic new weights; every other tensor in bfloat16 (cast exactly on copy)."""
    generator = torch.Generator().manual_seed(seed)
    weights = []
    for i, (name, shape) in enumerate(shapes.items()):
        tensor = torch.randn(shape, generator=generator)
        weights.append((name, tensor.to(torch.bfloat16 if i % 2 else torch.float32).to(device)))
    return weights


def reference_state(shapes: Shapes, seed: int) -> dict[str, Tensor]:
    """The parameters a model has after loading ``new_weights(shapes, seed)`` in-process."""
    model = tiny_model()
    model.load_weights(new_weights(shapes, seed))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def state(model: CausalLM) -> dict[str, Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def assert_state_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def shapes_of(model: CausalLM) -> Shapes:
    return {name: tuple(shape) for name, shape in model.expected_weight_shapes().items()}


# ── the sender process ─────────────────────────────────────────────────────────────────────


def sender_main(conn: Connection, device: str) -> None:
    """Serves requests until told to stop; keeps the last request's tensors alive (as a trainer
    must until the engine returned)."""
    alive: Any = None
    while True:
        kind, shapes, seeds, die = conn.recv()
        if kind == "stop":
            return
        entries = []
        if kind == "named":
            alive = new_weights(shapes, seeds[0], device)
            entries = [serialize_for_update(alive)]
        elif kind == "bucket":
            alive = []
            for seed in seeds:  # one entry per TP rank, each with its own weights
                entry, flat = flattened_bucket_request(new_weights(shapes, seed, device))
                entries += entry
                alive.append(flat)
        elif kind == "old_bucket":  # SGLang's single-dtype bucket, element offsets, dict metadata
            weights = [(n, t.float()) for n, t in new_weights(shapes, seeds[0], device)]
            alive = torch.cat([t.reshape(-1) for _, t in weights])
            metadata, offset = [], 0
            for name, tensor in weights:
                n = tensor.numel()
                metadata.append(
                    dict(name=name, shape=tensor.shape, dtype=torch.float32,
                         start_idx=offset, end_idx=offset + n, numel=n)
                )  # fmt: skip
                offset += n
            entries = [serialize_for_update({"flattened_tensor": alive, "metadata": metadata})]
        conn.send(entries)
        if die:
            os._exit(0)  # the handles go stale with this process


class Sender:
    def __init__(self, device: str = "cpu") -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(target=sender_main, args=(child, device))
        self.process.start()

    def request(self, kind: str, shapes: Shapes, seeds: tuple[int, ...], die: bool = False) -> Any:
        self.conn.send((kind, shapes, seeds, die))
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("stop", {}, (), False))
        self.process.join(timeout=30)
        assert self.process.exitcode == 0


@pytest.fixture(scope="module")
def sender() -> Iterator[Sender]:
    s = Sender()
    yield s
    s.stop()


@pytest.fixture
def model() -> CausalLM:
    return tiny_model()


def record(model: CausalLM) -> RefitRecord:
    assert isinstance(model.weight_observer, RefitRecord)
    return model.weight_observer


# ── tests ──────────────────────────────────────────────────────────────────────────────────


def test_named_tensors_from_another_process(sender: Sender, model: CausalLM) -> None:
    record(model).discarded()
    entries = sender.request("named", shapes_of(model), (1,))
    assert isinstance(entries[0], str)  # base64, as SGLang's output_str=True
    written = update_weights_from_tensor(model, entries)
    assert written == set(shapes_of(model))
    assert_state_equal(state(model), reference_state(shapes_of(model), 1))
    assert record(model).stale == set()


def test_flattened_bucket_takes_this_ranks_entry(sender: Sender, model: CausalLM) -> None:
    record(model).discarded()
    entries = sender.request("bucket", shapes_of(model), (2, 3))  # rank 0: seed 2, rank 1: 3
    written = update_weights_from_tensor(model, entries, load_format=FLATTENED_BUCKET, tp_rank=1)
    assert written == set(shapes_of(model))
    assert_state_equal(state(model), reference_state(shapes_of(model), 3))
    assert record(model).stale == set()


def test_single_dtype_bucket_with_dict_metadata(sender: Sender, model: CausalLM) -> None:
    entries = sender.request("old_bucket", shapes_of(model), (4,))
    update_weights_from_tensor(model, entries[0], load_format=FLATTENED_BUCKET, tp_rank=1)
    assert_state_equal(state(model), reference_state(shapes_of(model), 4))


@pytest.mark.parametrize("problem", ["name", "shape"])
def test_a_bad_name_or_shape_writes_nothing(sender: Sender, model: CausalLM, problem: str) -> None:
    shapes = shapes_of(model)
    if problem == "name":
        shapes["model.norm.weigth"] = shapes.pop("model.norm.weight")
    else:
        shapes["model.layers.1.mlp.down_proj.weight"] = (64, 32)
    before = state(model)
    entries = sender.request("bucket", shapes, (5,))
    with pytest.raises(WeightError, match="weigth" if problem == "name" else "down_proj"):
        update_weights_from_tensor(model, entries, load_format=FLATTENED_BUCKET)
    assert_state_equal(state(model), before)
    assert record(model).stale == set()  # nothing was written: the weights are intact


def test_a_sender_that_died_gives_the_typed_error(model: CausalLM) -> None:
    dying = Sender()
    entries = dying.request("named", shapes_of(model), (6,), die=True)
    dying.process.join(timeout=30)
    before = state(model)
    with pytest.raises(WeightTransferError, match="stale"):
        update_weights_from_tensor(model, entries)
    assert_state_equal(state(model), before)


def test_a_corrupted_entry_gives_the_typed_error(sender: Sender, model: CausalLM) -> None:
    entry = sender.request("named", shapes_of(model), (7,))[0]
    raw = bytearray(base64.b64decode(entry))
    raw[len(raw) // 2 : len(raw) // 2 + 16] = b"\xff" * 16
    before = state(model)
    with pytest.raises(WeightTransferError):
        update_weights_from_tensor(model, [base64.b64encode(bytes(raw)).decode()])
    with pytest.raises(WeightTransferError):
        update_weights_from_tensor(model, [entry[:-7] + "!!!!!!!"])  # not base64
    assert_state_equal(state(model), before)


class _RunsCode:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo pwned > /dev/null",))


def test_unpickling_is_restricted_to_tensor_handles(model: CausalLM) -> None:
    payload = pickle.dumps([("model.norm.weight", _RunsCode())])
    with pytest.raises(WeightTransferError, match="refused to load"):
        update_weights_from_tensor(model, [payload])


def test_bucket_metadata_that_does_not_fit_its_buffer(model: CausalLM) -> None:
    weights = new_weights(shapes_of(model), 8)
    flat, metadata = make_flattened_bucket(weights)
    metadata[-1].end_idx += 2  # past the end of the buffer
    with pytest.raises(WeightTransferError, match=r"lm_head\.weight"):
        unflatten_bucket({"flattened_tensor": flat, "metadata": metadata})
    with pytest.raises(WeightTransferError, match="'flattened_tensor' and 'metadata'"):
        unflatten_bucket([flat])


def test_an_empty_bucket_writes_nothing(model: CausalLM) -> None:
    before = state(model)
    empty = serialize_for_update(
        {"flattened_tensor": torch.empty(0, dtype=torch.uint8), "metadata": []}
    )
    assert update_weights_from_tensor(model, [empty], load_format=FLATTENED_BUCKET) == set()
    assert_state_equal(state(model), before)


def test_an_unknown_load_format_is_refused(model: CausalLM) -> None:
    with pytest.raises(UnsupportedOptionError, match="direct"):
        update_weights_from_tensor(model, [b""], load_format="direct")


def test_flattened_bucket_round_trip_in_process() -> None:
    weights = [("a", torch.randn(3, 5)), ("b", torch.randn(7).bfloat16()), ("c", torch.ones(2, 2))]
    flat, metadata = make_flattened_bucket(weights)
    assert flat.dtype == torch.uint8
    assert [(m.start_idx, m.end_idx) for m in metadata] == [(0, 60), (64, 78), (80, 96)]
    rebuilt = unflatten_bucket({"flattened_tensor": flat, "metadata": metadata})
    for (name, tensor), (rebuilt_name, view) in zip(weights, rebuilt, strict=True):
        assert rebuilt_name == name and view.dtype == tensor.dtype and torch.equal(view, tensor)


def test_an_unpadded_bucket_as_sglang_packs_it() -> None:
    """SGLang packs back to back: "c" (float32) starts at byte 74, not a multiple of 4."""
    weights = [("a", torch.randn(3, 5)), ("b", torch.randn(7).bfloat16()), ("c", torch.ones(2, 2))]
    parts = [t.reshape(-1).view(torch.uint8) for _, t in weights]
    ends = torch.tensor([p.numel() for p in parts]).cumsum(0).tolist()
    metadata = [
        dict(
            name=n,
            shape=t.shape,
            dtype=t.dtype,
            start_idx=e - p.numel(),
            end_idx=e,
            numel=p.numel(),
        )
        for (n, t), p, e in zip(weights, parts, ends, strict=True)
    ]
    rebuilt = unflatten_bucket({"flattened_tensor": torch.cat(parts), "metadata": metadata})
    for (name, tensor), (rebuilt_name, view) in zip(weights, rebuilt, strict=True):
        assert rebuilt_name == name and view.dtype == tensor.dtype and torch.equal(view, tensor)


def test_iter_buckets_bounds_each_bucket() -> None:
    weights = [(str(i), torch.empty(256)) for i in range(10)] + [("big", torch.empty(4096))]
    buckets = list(iter_buckets(weights, bucket_bytes=3 * 1024))  # three 1 KiB tensors each
    assert [len(b) for b in buckets] == [3, 3, 3, 1, 1]
    assert [name for b in buckets for name, _ in b] == [name for name, _ in weights]


@pytest.mark.gpu
def test_cuda_ipc_flattened_bucket_from_another_process() -> None:
    model = tiny_model("cuda")
    record(model).discarded()
    cuda_sender = Sender("cuda")
    try:
        entries = cuda_sender.request("bucket", shapes_of(model), (9,))
        written = update_weights_from_tensor(model, entries, load_format=FLATTENED_BUCKET)
        named = cuda_sender.request("named", shapes_of(model), (10,))
        assert update_weights_from_tensor(model, named) == written
    finally:
        cuda_sender.stop()
    assert written == set(shapes_of(model))
    assert_state_equal(state(model), reference_state(shapes_of(model), 10))
    assert record(model).stale == set()
