"""A Qwen3-MoE model through the engine on the CPU: greedy tokens equal transformers', the
sleep/wake cycles keep them, and every refit path writes the fused experts from HF per-expert
names (``update_weights``, the model object's ``load_weights``, ``update_weights_from_tensor``
named and as a flattened bucket, a weight-update group), each equal to a fresh engine on the
new weights. Wrong expert names and shapes raise the typed error and change nothing."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from dormant import LLM, SamplingParams
from dormant.engine import WeightsNotLoadedError
from dormant.executors.multiproc import free_port
from dormant.models import WeightError
from dormant.worker.ipc_weights import FLATTENED_BUCKET, flattened_bucket_request
from dormant.worker.update_group import broadcast_weights, create_update_group
from tests.engine.conftest import PROMPTS, tokens
from tests.engine.moe_checkpoint import hf_moe_model, moe_state_dict, write_moe_checkpoint

pytestmark = pytest.mark.parametrize("device", ["cpu"])
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
OPTIONS = dict(device="cpu", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=4 << 20)
EXPERT = "model.layers.2.mlp.experts"


@pytest.fixture(scope="module")
def moe_a(tmp_path_factory: pytest.TempPathFactory):
    return write_moe_checkpoint(tmp_path_factory.mktemp("moe_a"), seed=1)


@pytest.fixture(scope="module")
def moe_b(tmp_path_factory: pytest.TempPathFactory):
    return write_moe_checkpoint(tmp_path_factory.mktemp("moe_b"), seed=2)


@pytest.fixture(scope="module")
def expected_b(moe_b) -> list[tuple[int, ...]]:
    """What a fresh engine generates on the new weights."""
    with LLM(str(moe_b), **OPTIONS) as fresh:
        return tokens(fresh.generate(PROMPTS, GREEDY))


def _hf_greedy(seed: int, prompt: list[int], num_steps: int) -> tuple[int, ...]:
    model = hf_moe_model(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_steps):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return tuple(ids[len(prompt) :])


def test_the_engine_decodes_what_transformers_decodes(make_llm, moe_a) -> None:
    llm = make_llm(str(moe_a))
    assert type(llm.llm_engine.executor.worker.model).__name__ == "Qwen3MoeForCausalLM"
    ours = tokens(llm.generate(PROMPTS, GREEDY))  # continuous batching over the three prompts
    assert [tuple(t) for t in ours] == [_hf_greedy(1, p, 16) for p in PROMPTS]


def test_the_fused_experts_live_in_the_weights_tag(make_llm, moe_a) -> None:
    llm = make_llm(str(moe_a), memory_strict=True)
    worker = llm.llm_engine.executor.worker
    sparse = [layer.mlp for layer in worker.model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(sparse) == 2  # layers 0 and 2; layer 1 is dense
    for mlp in sparse:
        for tensor in (mlp.experts.w13_weight, mlp.experts.w2_weight, mlp.gate.weight):
            assert worker.mm.tag_of(tensor) == "weights"
    assert len(llm.audit()[0].by_tag("kv_cache")) == 1  # the KV backing, and nothing else


def test_level_1_and_level_2_cycles_keep_the_tokens(make_llm, moe_a) -> None:
    llm = make_llm(str(moe_a))
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(level=1)
    assert llm.memory_status()[0].tag("weights").state == "offloaded"
    llm.wake_up()
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.update_weights(moe_state_dict(moe_a))  # every expert by its HF name
    llm.wake_up(["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected


def test_update_weights_by_expert_name_after_level_2(make_llm, moe_a, moe_b, expected_b) -> None:
    llm = make_llm(str(moe_a))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.update_weights(moe_state_dict(moe_b))
    llm.wake_up(["kv_cache"])
    after = tokens(llm.generate(PROMPTS, GREEDY))
    assert after == expected_b and after != before


def test_a_refit_missing_one_expert_refuses_to_generate(make_llm, moe_a, moe_b) -> None:
    llm = make_llm(str(moe_a))
    llm.sleep(level=2)
    llm.wake_up()
    missing = f"{EXPERT}.5.up_proj.weight"
    llm.update_weights({n: t for n, t in moe_state_dict(moe_b).items() if n != missing})
    with pytest.raises(WeightsNotLoadedError, match=r"experts\.5\.up_proj"):
        llm.generate(PROMPTS, GREEDY)
    llm.update_weights({missing: moe_state_dict(moe_b)[missing]})
    assert len(tokens(llm.generate(PROMPTS, GREEDY))) == len(PROMPTS)


def test_the_model_object_path_writes_expert_by_expert(make_llm, moe_a, moe_b, expected_b):
    """TRL's loop: one ``model.load_weights([(name, tensor)])`` per HF-named tensor."""
    llm = make_llm(str(moe_a))
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for name, tensor in moe_state_dict(moe_b).items():
        model.load_weights([(name, tensor)])
    llm.wake_up(tags=["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected_b


def test_a_transformers_5_trainer_refits_with_its_fused_expert_names(make_llm, moe_a, expected_b):
    """TRL's loop over ``named_parameters()`` of a transformers 5 model, whose experts are
    ``experts.gate_up_proj`` / ``experts.down_proj``: the refit is complete, not stale."""
    trainer = hf_moe_model(2)
    assert any(name.endswith("experts.gate_up_proj") for name, _ in trainer.named_parameters())
    llm = make_llm(str(moe_a))
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for name, param in trainer.named_parameters():
        model.load_weights([(name, param.detach())])
    llm.wake_up(tags=["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected_b


def test_update_weights_from_tensor_named_and_flattened(make_llm, moe_a, moe_b, expected_b):
    llm = make_llm(str(moe_a))
    before = tokens(llm.generate(PROMPTS, GREEDY))
    llm.update_weights_from_tensor(list(moe_state_dict(moe_b).items()))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected_b
    entries, flat = flattened_bucket_request(list(moe_state_dict(moe_a).items()))
    llm.update_weights_from_tensor(entries, load_format=FLATTENED_BUCKET)
    del flat
    assert tokens(llm.generate(PROMPTS, GREEDY)) == before


def _trainer(port: int, checkpoint: str, conn: Connection) -> None:
    """Rank 0 of a weight-update group: broadcasts the checkpoint's per-expert tensors."""
    group = create_update_group("127.0.0.1", port, 0, 2, "moe", "gloo", timeout_s=60)
    weights = list(moe_state_dict(Path(checkpoint)).items())
    conn.send([(name, str(t.dtype), list(t.shape)) for name, t in weights])
    broadcast_weights(group, weights, timeout_s=60)
    conn.recv()


def test_a_weight_update_group_refits_the_experts(make_llm, moe_a, moe_b, expected_b) -> None:
    llm = make_llm(str(moe_a))
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    context, port = mp.get_context("spawn"), free_port()
    conn, child = context.Pipe()
    trainer = context.Process(target=_trainer, args=(port, str(moe_b), child), daemon=True)
    trainer.start()
    try:
        llm.init_weights_update_group("127.0.0.1", port, 1, 2, "moe", backend="gloo")
        names, dtypes, shapes = zip(*conn.recv(), strict=True)
        assert any(".experts.7.down_proj." in name for name in names)
        llm.update_weights_from_distributed(names, dtypes, shapes, "moe")
        conn.send(None)
        llm.destroy_weights_update_group("moe")
    finally:
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()
    llm.wake_up(["kv_cache"])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected_b


def test_wrong_expert_names_and_shapes_raise_and_change_nothing(make_llm, moe_a, moe_b) -> None:
    llm = make_llm(str(moe_a))
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    weights = moe_state_dict(moe_b)
    weights[f"{EXPERT}.8.down_proj.weight"] = torch.zeros(64, 32)  # 8 experts: 0..7
    weights[f"{EXPERT}.3.gate_proj.weight"] = torch.zeros(64, 32)  # transposed
    weights["model.layers.1.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)  # dense layer
    with pytest.raises(WeightError) as info:
        llm.update_weights(weights)
    message = str(info.value)
    assert f"{EXPERT}.8.down_proj.weight: no such expert: this layer has experts 0..7" in message
    assert f"{EXPERT}.3.gate_proj.weight: shape (64, 32), expected (32, 64)" in message
    assert "model.layers.1.mlp.experts.0.up_proj.weight: this layer is dense" in message
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected  # nothing was written
