"""``byte_copy.copy_bytes`` on the SMs (``SM_COPIES``) on the GPU: bit-exact at every alignment
it takes, one ``bitwise_or`` kernel where a word fits, and a flattened bucket's copy plan (what
the IPC refit runs) writes with it exactly what ``load_weights`` writes."""

from __future__ import annotations

import pytest
import torch

from dormant.models import ModelConfig, build_model
from dormant.worker import byte_copy
from dormant.worker.copy_plans import CopyPlans
from dormant.worker.ipc_weights import bucket_items, make_flattened_bucket

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 128, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture
def kernels(monkeypatch) -> list[torch.dtype]:
    """SM copies on; the dtype of every ``bitwise_or`` launched."""
    monkeypatch.setattr(byte_copy, "SM_COPIES", True)
    launched: list[torch.dtype] = []
    bitwise_or = torch.bitwise_or

    def spy(src, other, *, out):
        launched.append(src.dtype)
        return bitwise_or(src, other, out=out)

    monkeypatch.setattr(torch, "bitwise_or", spy)
    return launched


@pytest.mark.parametrize(
    ("offset", "nbytes", "word"),
    [(0, 64 << 20, torch.int32), (2, 4098, torch.int16), (1, 4097, None), (4, 12, torch.int32)],
)  # fmt: skip
def test_sm_copies_are_bit_exact_at_every_alignment(kernels, offset, nbytes, word) -> None:
    src = torch.randint(0, 256, (nbytes + 32,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    byte_copy.copy_bytes(dst[offset : offset + nbytes], src[16 + offset : 16 + offset + nbytes])
    torch.cuda.synchronize()
    assert torch.equal(dst[offset : offset + nbytes], src[16 + offset : 16 + offset + nbytes])
    assert not dst[:offset].any() and not dst[offset + nbytes :].any()
    assert kernels == ([] if word is None else [word])


def test_a_bucket_copied_on_the_sms_writes_what_load_weights_writes(kernels) -> None:
    config = ModelConfig.from_dict(TINY_QWEN3)
    with torch.device("cuda"):
        model, reference = build_model(config), build_model(config)
    generator = torch.Generator("cuda").manual_seed(3)
    named = [
        (name, torch.randn(shape, device="cuda", generator=generator).bfloat16())
        for name, shape in model.expected_weight_shapes().items()
    ]
    flat, metadata = make_flattened_bucket(named)
    flat_bytes, items = bucket_items({"flattened_tensor": flat, "metadata": metadata})
    CopyPlans().get(model, items).run(model, flat_bytes)
    reference.load_weights(named)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    assert kernels and set(kernels) <= {torch.int32, torch.int16}
