"""A trainer for the weight-update group tests: rank 0 of a gloo group in a spawned process,
scripted by rounds, beside an engine rank (``WeightUpdateGroups``) in the test process; and the
tiny model whose weights both sides know.

Each round, the trainer broadcasts what it was given, as slime does beside its request, whatever
the engine answers; then it tells the engine how its broadcast ended (``Trainer.outcome``).
Where that broadcast failed (the engine destroyed the group), or the round told it to abort its
side, it destroys its side and hosts a new group on a new port, which the engine joins
(``Trainer.rejoin``). It waits for ``next_round`` before each next round."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Literal

import torch
from torch import Tensor
from torch.distributed import distributed_c10d as c10d

from dormant.models import CausalLM, ModelConfig, build_model
from dormant.models import weights as weight_io
from dormant.worker.refit_record import RefitRecord
from dormant.worker.update_group import WeightUpdateGroups, broadcast_weights, create_update_group

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "torch_dtype": "float32", "tie_word_embeddings": False,
}  # fmt: skip
GROUP = "refit"
OK = "ok"
Shapes = dict[str, tuple[int, ...]]
Weights = list[tuple[str, Tensor]]


def tiny_model() -> CausalLM:
    model = build_model(ModelConfig.from_dict(TINY_QWEN3))
    model.init_buffers()
    model.reset_kv_scales()
    model.init_random_weights(0)
    model.weight_observer = RefitRecord(model.expected_weight_shapes())
    return model


def record_of(model: CausalLM) -> RefitRecord:
    assert isinstance(model.weight_observer, RefitRecord)
    return model.weight_observer


def shapes_of(model: CausalLM) -> Shapes:
    return {name: tuple(shape) for name, shape in model.expected_weight_shapes().items()}


def new_weights(shapes: Shapes, seed: int) -> Weights:
    """Deterministic new weights; every other tensor in bfloat16 (cast exactly on copy)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            name,
            torch.randn(shape, generator=generator).to(torch.bfloat16 if i % 2 else torch.float32),
        )
        for i, (name, shape) in enumerate(shapes.items())
    ]


def request(weights: Weights) -> tuple[list[str], list[str], list[list[int]]]:
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


def failing_write(after: int) -> Callable[..., set[str]]:
    """A ``weights.load_weights`` (monkeypatch it in) that writes ``after`` tensors, then fails
    on the next, as a copy failing partway would."""
    load_weights = weight_io.load_weights

    def load(table: dict, is_tied: bool, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        load_weights(table, is_tied, itertools.islice(iter(weights), after))
        raise RuntimeError(f"injected: copy {after + 1} failed")

    return load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Round:
    """What the trainer broadcasts in one round: ``weights`` one by one, or (``flat``) their
    bytes back to back in one uint8 buffer, as SGLang's ``FlattenedTensorBucket`` packs them;
    then ``after``: wait for the next round, ``abort`` its side of the group (a trainer failing
    midway) and rejoin, ``die`` or ``hang``."""

    weights: Weights
    flat: bool = False
    after: Literal["next", "abort", "die", "hang"] = "next"


def trainer_main(port: int, rounds: list[Round], conn: Connection) -> None:
    group = create_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=30)
    for round_ in rounds:
        outcome = _broadcast(group, round_)
        conn.send(outcome)
        if round_.after == "die":
            os._exit(1)
        if round_.after == "hang":
            time.sleep(60)
        if outcome != OK or round_.after == "abort":
            c10d._abort_process_group(group)
            del group  # freed, its connections close: a receive pending over it fails at once
            port = free_port()
            conn.send(port)
            group = create_update_group("127.0.0.1", port, 0, 2, GROUP, "gloo", timeout_s=30)
        conn.recv()  # the engine finished this round
    torch.distributed.destroy_process_group(group)


def _broadcast(group: torch.distributed.ProcessGroup, round_: Round) -> str:
    tensors = round_.weights
    if round_.flat:
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in tensors])
        tensors = [("bucket", flat)]
    try:
        broadcast_weights(group, tensors, timeout_s=30)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return OK


class Trainer:
    def __init__(self, rounds: list[Round]) -> None:
        self.port = free_port()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=trainer_main, args=(self.port, rounds, child))
        self.process.start()

    def join(self, groups: WeightUpdateGroups) -> None:
        groups.init_weights_update_group("127.0.0.1", self.port, 1, 2, GROUP, "gloo")

    def outcome(self) -> str:
        """How the trainer's broadcast of this round ended: ``OK`` or its error."""
        assert self.conn.poll(60), "the trainer's broadcast did not end"
        return str(self.conn.recv())

    def rejoin(self, groups: WeightUpdateGroups) -> None:
        """Joins the group the trainer hosts again after its side was destroyed."""
        self.port = self.conn.recv()
        self.join(groups)

    def next_round(self) -> None:
        self.conn.send(None)

    def finish(self, timeout: float = 30) -> int | None:
        self.process.join(timeout=timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return self.process.exitcode
