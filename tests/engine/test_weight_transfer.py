"""vLLM's weight-transfer API (vllm/distributed/weight_transfer, ``LLM.init_weight_transfer_engine``
/ ``start_weight_update`` / ``update_weights(request)`` / ``finish_weight_update``) on the CPU,
over gloo: the trainer, in a process of its own, runs vLLM's trainer helpers as
``install_as_vllm()`` provides them (the >= 0.28 ``nccl_common.trainer_init`` with
``packed_nccl_broadcast_producer``, and the older ``NCCLWeightTransferEngine`` statics), and
the engine's tokens then equal a fresh engine's on the new weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from dormant import LLM
from dormant.core.config import EngineConfig
from dormant.core.errors import UnsupportedOptionError
from dormant.engine.weight_transfer import WeightTransfer, WeightTransferSessionError
from dormant.vllm_weight_transfer import packed_chunks
from tests.engine.conftest import GREEDY, PROMPTS, tokens
from tests.engine.vllm_trainer import SMALL_BUFFER, init_info, start_trainer, update_info

CONFIG = {"weight_transfer_config": {"backend": "nccl"}}


def test_a_trainer_refits_through_vllms_weight_transfer_api(
    make_llm, device: str, checkpoint: Path, other_checkpoint: Path, tmp_path: Path
) -> None:
    if device == "cuda":
        pytest.skip("NCCL needs the trainer on a GPU of its own: a multi-GPU test (issue 20)")
    expected_2 = tokens(make_llm(str(other_checkpoint)).generate(PROMPTS, GREEDY))
    llm: LLM = make_llm(str(checkpoint), **CONFIG)
    before = tokens(llm.generate(PROMPTS, GREEDY))
    port, parent, trainer = start_trainer([(2, "packed"), (3, "one by one")])
    try:
        info = init_info(port, packed=True, packed_buffer_size_bytes=SMALL_BUFFER)
        llm.init_weight_transfer_engine({"init_info": info})
        assert parent.recv() == "joined"

        llm.start_weight_update()
        with pytest.raises(WeightTransferSessionError, match="finish_weight_update first"):
            llm.start_weight_update()
        metadata = parent.recv()
        parent.send("go")
        llm.update_weights({"update_info": update_info(metadata)})  # packed: init said so
        llm.finish_weight_update(weight_version="step-2")
        assert tokens(llm.generate(PROMPTS, GREEDY)) == expected_2 != before
        assert llm.get_weight_version() == "step-2"

        llm.start_weight_update(is_checkpoint_format=True)
        metadata = parent.recv()
        parent.send("go")
        # vLLM < 0.28 says "packed" per update
        llm.update_weights({"update_info": update_info(metadata, packed=False)})
        llm.finish_weight_update()
        with pytest.raises(WeightTransferSessionError, match="before start_weight_update"):
            llm.update_weights({"update_info": update_info(metadata)})  # refused: destroyed
        with pytest.raises(WeightTransferSessionError, match="init_weight_transfer_engine"):
            llm.start_weight_update()
        assert tokens(llm.generate(PROMPTS, GREEDY)) == tokens(
            make_llm(str(_seed3(tmp_path))).generate(PROMPTS, GREEDY)
        )
        parent.send("done")
    finally:
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0


def _seed3(tmp_path: Path) -> Path:
    from tests.engine.conftest import write_checkpoint

    return write_checkpoint(tmp_path / "seed3", seed=3)


def test_calls_out_of_order_or_unconfigured_are_refused(
    make_llm, device: str, checkpoint: Path
) -> None:
    plain = make_llm(str(checkpoint))
    with pytest.raises(WeightTransferSessionError, match="weight_transfer_config"):
        plain.init_weight_transfer_engine({"init_info": {}})
    expected = tokens(plain.generate(PROMPTS, GREEDY))
    llm = make_llm(str(checkpoint), **CONFIG)
    with pytest.raises(WeightTransferSessionError, match="init_weight_transfer_engine"):
        llm.start_weight_update()
    with pytest.raises(WeightTransferSessionError, match="missing"):
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1"}})
    with pytest.raises(WeightTransferSessionError, match="backend"):
        wrong = "gloo" if device == "cuda" else "nccl"  # not what this engine's ranks use
        info = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                "world_size": 2, "backend": wrong}  # fmt: skip
        llm.init_weight_transfer_engine({"init_info": info})
    with pytest.raises(UnsupportedOptionError, match="weight_transfer_config"):
        EngineConfig.create(str(checkpoint), weight_transfer_config={"backend": "ipc"})
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected


def test_packed_chunks_end_with_the_tensor_that_passes_the_buffer() -> None:
    """vllm/distributed/weight_transfer/packed_tensor.py ``pack_tensors``: a chunk closes once
    its bytes exceed the buffer, so a tensor larger than the buffer is a chunk of its own."""
    sizes = [3, 3, 3, 10, 1, 1]
    assert list(packed_chunks(sizes, int, 5)) == [[3, 3], [3, 10], [1, 1]]
    assert list(packed_chunks(sizes, int, 100)) == [sizes]
    assert list(packed_chunks([], int, 5)) == []


class _Refits:
    """Records what ``WeightTransfer`` asks of every rank (no ranks, no group)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.weight_version = "default"

    def init_weights_update_group(self, *args: object) -> None:
        self.calls.append("init")

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.calls.append("destroy")

    def update_weights_from_distributed(self, *args: object, **kwargs: object) -> None:
        self.calls.append("receive")


@pytest.mark.parametrize(
    "bad",
    [
        {"names": "w", "dtype_names": ["float32"], "shapes": [[2]]},  # a string, not a list
        {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2.5]]},
        {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2], [3]]},  # lengths differ
        {"names": ["w"], "dtype_names": [1], "shapes": [[2]]},
        {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "packed": "yes"},
        {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "extra": 1},
    ],
)
def test_an_update_that_does_not_say_what_arrives_receives_nothing_and_destroys_the_group(
    bad: dict,
) -> None:
    """The group cannot know what the trainer broadcasts beside such an update, so it receives
    nothing and destroys the group (the trainer's broadcast then fails instead of waiting),
    and says so; the session ends."""
    refits = _Refits()
    transfer = WeightTransfer(refits, {"backend": "nccl"}, "cpu")  # type: ignore[arg-type]
    transfer.init({"init_info": init_info(1)})
    transfer.start()
    with pytest.raises(WeightTransferSessionError, match="destroyed"):
        transfer.update({"update_info": bad})
    assert refits.calls == ["init", "destroy"]
    with pytest.raises(WeightTransferSessionError, match="init_weight_transfer_engine"):
        transfer.start()
