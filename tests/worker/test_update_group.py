"""A weight-update group over gloo: a spawned trainer process (rank 0) broadcasts new weights to
an engine rank in the test process (rank 1)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from multiprocessing.connection import Connection

import pytest
import torch
from torch import Tensor

from dormant.models import CausalLM, ModelConfig, WeightError, build_model
from dormant.worker.ipc_weights import FLATTENED_BUCKET, make_flattened_bucket
from dormant.worker.refit_record import RefitRecord
from dormant.worker.transfer_errors import UpdateGroupError, WeightTransferError
from dormant.worker.update_group import (
    WeightUpdateGroups,
    broadcast_weights,
    create_update_group,
)

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "torch_dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip
GROUP = "refit"
Shapes = dict[str, tuple[int, ...]]


def tiny_model() -> CausalLM:
    model = build_model(ModelConfig.from_dict(TINY_QWEN3))
    model.init_buffers()
    model.reset_kv_scales()
    model.init_random_weights(0)
    model.weight_observer = RefitRecord(model.expected_weight_shapes())
    return model


def shapes_of(model: CausalLM) -> Shapes:
    return {name: tuple(shape) for name, shape in model.expected_weight_shapes().items()}


def new_weights(shapes: Shapes, seed: int) -> list[tuple[str, Tensor]]:
    """Deterministic new weights; every other tensor in bfloat16 (cast exactly on copy)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            name,
            torch.randn(shape, generator=generator).to(torch.bfloat16 if i % 2 else torch.float32),
        )
        for i, (name, shape) in enumerate(shapes.items())
    ]


def request(weights: list[tuple[str, Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """SGLang's (names, dtypes, shapes) lists, dtypes as strings as slime sends them."""
    return (
        [n for n, _ in weights],
        [str(t.dtype).removeprefix("torch.") for _, t in weights],
        [list(t.shape) for _, t in weights],
    )


def state(model: CausalLM) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_state_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def reference_state(shapes: Shapes, seed: int) -> dict[str, Tensor]:
    model = tiny_model()
    model.load_weights(new_weights(shapes, seed))
    return state(model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trainer_main(
    port: int, shapes: Shapes, rounds: list[tuple[str, int]], conn: Connection
) -> None:
    """Rank 0: hosts the rendezvous, then broadcasts one round per entry of ``rounds``:
    ``("tensors", seed)`` one by one, ``("flat", seed)`` as one flattened bucket,
    ``("die", k)`` the first k tensors and exits, ``("hang", k)`` the first k and stalls."""
    group = create_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=30)
    for kind, arg in rounds:
        weights = new_weights(shapes, arg if kind in ("tensors", "flat") else 0)
        if kind == "tensors":
            broadcast_weights(group, weights, timeout_s=30)
        elif kind == "flat":
            broadcast_weights(group, [("bucket", make_flattened_bucket(weights)[0])], 30)
        else:
            broadcast_weights(group, weights[:arg], timeout_s=30)
            if kind == "die":
                os._exit(1)
            time.sleep(60)
        conn.recv()  # the engine finished this round
    torch.distributed.destroy_process_group(group)


class Trainer:
    def __init__(self, shapes: Shapes, rounds: list[tuple[str, int]]) -> None:
        self.port = free_port()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=trainer_main, args=(self.port, shapes, rounds, child))
        self.process.start()

    def round_done(self) -> None:
        self.conn.send(None)

    def finish(self, timeout: float = 30) -> int | None:
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return self.process.exitcode


def join(groups: WeightUpdateGroups, trainer: Trainer) -> None:
    groups.init_weights_update_group("127.0.0.1", trainer.port, 1, 2, GROUP, "gloo")


def test_broadcast_refits_exactly_in_buckets_and_as_one_flat_bucket() -> None:
    model = tiny_model()
    shapes = shapes_of(model)
    record = model.weight_observer
    assert isinstance(record, RefitRecord)
    bad_names, bad_dtypes, bad_shapes = request(new_weights(shapes, 1))
    bad_names[3] = "model.layers.0.self_attn.q_prog.weight"
    trainer = Trainer(shapes, [("tensors", 1), ("tensors", 2), ("flat", 3)])
    groups = WeightUpdateGroups(bucket_bytes=8 << 10, timeout_s=20)  # several buckets
    join(groups, trainer)
    assert groups.names() == (GROUP,)

    # A request that does not fit: refused before any write; its broadcasts are drained.
    before = state(model)
    with pytest.raises(WeightError, match="q_prog"):
        groups.update_weights_from_distributed(model, bad_names, bad_dtypes, bad_shapes, GROUP)
    assert_state_equal(state(model), before)
    trainer.round_done()

    record.discarded()
    written = groups.update_weights_from_distributed(model, *request(new_weights(shapes, 2)), GROUP)
    assert written == set(shapes) and record.stale == set()
    assert_state_equal(state(model), reference_state(shapes, 2))
    trainer.round_done()

    record.discarded()
    groups.update_weights_from_distributed(
        model, *request(new_weights(shapes, 3)), GROUP, load_format=FLATTENED_BUCKET
    )
    assert record.stale == set()
    assert_state_equal(state(model), reference_state(shapes, 3))
    trainer.round_done()

    groups.destroy_weights_update_group(GROUP)
    assert groups.names() == ()
    assert trainer.finish() == 0


@pytest.mark.parametrize("failure", ["die", "hang"])
def test_a_sender_lost_mid_broadcast_marks_every_weight_stale(failure: str) -> None:
    model = tiny_model()
    shapes = shapes_of(model)
    record = model.weight_observer
    assert isinstance(record, RefitRecord)
    trainer = Trainer(shapes, [(failure, 5)])
    groups = WeightUpdateGroups(bucket_bytes=1 << 10, timeout_s=3.0)  # bucket: one tensor
    join(groups, trainer)
    # A stalled sender under load may time out before its 5th tensor arrived.
    expected = "after 5 of 25" if failure == "die" else r"after [0-5] of 25"
    with pytest.raises(WeightTransferError, match=expected) as error:
        groups.update_weights_from_distributed(model, *request(new_weights(shapes, 0)), GROUP)
    assert record.stale == set(shapes)  # the observer was told: failed()
    assert groups.names() == ()  # the broken group is gone; the trainer must create it again
    if failure == "hang":
        assert "timed out" in str(error.value.__cause__).lower()
    trainer.finish(timeout=0 if failure == "hang" else 30)


def test_bad_group_calls_raise_and_change_nothing() -> None:
    groups = WeightUpdateGroups(tp_rank=1, timeout_s=1.0)
    with pytest.raises(UpdateGroupError, match="no weight-update group"):
        groups.update_weights_from_distributed(tiny_model(), [], [], [], "missing")
    with pytest.raises(UpdateGroupError, match=r"outside 1\.\.1"):
        groups.init_weights_update_group("127.0.0.1", free_port(), 1, 2, GROUP, "gloo")
    with pytest.raises(UpdateGroupError, match="backend"):
        groups.init_weights_update_group("127.0.0.1", free_port(), 0, 3, GROUP, "mpi")
    assert groups.names() == ()


def test_a_rendezvous_nobody_hosts_times_out() -> None:
    groups = WeightUpdateGroups(timeout_s=1.0)
    with pytest.raises(WeightTransferError, match="could not join"):
        groups.init_weights_update_group("127.0.0.1", free_port(), 1, 2, GROUP, "gloo")
    assert groups.names() == ()
