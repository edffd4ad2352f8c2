"""Data integrity across sleep and wake: bit-exact HOST, zero/poison DISCARD, stable addresses."""

from __future__ import annotations

import pytest
import torch

from dormant.memory import MemoryManager
from tests.memory.helpers import random_fill, same_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.uint8]
# Odd sizes: a slab block, just under / over the slab limit, several granules plus a tail.
SIZES = [1, 7, 1023, (512 << 10) - 3, (512 << 10) + 5, (5 << 20) + 11]


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_policy_is_bit_exact(mm: MemoryManager, dtype: torch.dtype) -> None:
    tensors = [mm.empty((n,), dtype, "weights") for n in SIZES]
    expected = [random_fill(t, seed) for seed, t in enumerate(tensors)]
    for level in (1, 1):
        mm.sleep(level=level)
        mm.wake_up()
        for t, e in zip(tensors, expected, strict=True):
            assert same_bytes(t, e)


def test_multidimensional_and_packed_tensors(mm: MemoryManager) -> None:
    a, b, c = mm.empty_many(
        [((3, 5, 7), torch.float32), ((11,), torch.int16), ((2, 2), torch.bfloat16)], "runtime"
    )
    assert a.shape == (3, 5, 7) and b.dtype == torch.int16 and c.shape == (2, 2)
    expected = [random_fill(t, i) for i, t in enumerate((a, b, c))]
    assert a.data_ptr() % 256 == 0 and b.data_ptr() % 256 == 0
    mm.sleep(level=2)
    mm.wake_up()
    for t, e in zip((a, b, c), expected, strict=True):
        assert same_bytes(t, e)


@pytest.mark.parametrize("nbytes", [64, 3 << 20])
def test_discard_reads_zero(mm: MemoryManager, nbytes: int) -> None:
    kv = mm.empty((nbytes,), torch.uint8, "kv_cache")
    kv.fill_(0xAB)
    mm.sleep(level=1)
    mm.wake_up()
    assert int(kv.max()) == 0 and int(kv.min()) == 0


def test_discard_reads_poison_in_poison_mode(make_mm) -> None:
    mm = make_mm(poison=True)
    kv = mm.empty((1 << 20,), torch.float32, "kv_cache")
    small = mm.empty((10,), torch.bfloat16, "kv_cache")
    kv.fill_(1.0)
    mm.sleep(level=1)
    mm.wake_up()
    assert torch.isnan(kv).all() and torch.isnan(small).all()
    assert int(kv.view(torch.uint8).min()) == 0xFF


def test_addresses_unchanged_across_100_cycles(mm: MemoryManager) -> None:
    w = mm.empty((3 << 20,), torch.uint8, "weights")
    kv = mm.empty((3 << 20,), torch.uint8, "kv_cache")
    table = mm.empty((64,), torch.int32, "runtime")
    expected = random_fill(w, 7)
    table.copy_(torch.arange(64, dtype=torch.int32))
    addresses = [t.data_ptr() for t in (w, kv, table)]
    for cycle in range(100):
        mm.sleep(level=1 + cycle % 2)
        mm.wake_up()
        if cycle % 2:  # level 2 discarded the weights: refit them in place, as an engine would
            w.copy_(expected)
        assert [t.data_ptr() for t in (w, kv, table)] == addresses
    assert same_bytes(w, expected)
    assert torch.equal(table.cpu(), torch.arange(64, dtype=torch.int32))


def test_adopt_moves_parameters_and_buffers(mm: MemoryManager) -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)]
    model = torch.nn.Sequential(*layers).to(mm.backend.device)
    model.register_buffer("scale", torch.tensor([0.5, 0.25], device=mm.backend.device))
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    x = torch.randn(3, 16, device=mm.backend.device)
    y = model(x)
    mm.adopt(model)
    assert all(p.device.type == mm.backend.device.type for p in model.parameters())
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # identities kept
    audit = mm.audit(["weights", "runtime"])
    assert {r.tag for r in audit.records} == {"weights", "runtime"}
    assert all(r.kind == "adopted" and r.is_declared for r in audit.records)
    mm.sleep(level=1)
    mm.wake_up()
    for p, b in zip(model.parameters(), before, strict=True):
        assert same_bytes(p.detach(), b)
    assert torch.equal(model.scale.cpu(), torch.tensor([0.5, 0.25]))
    torch.testing.assert_close(model(x), y, rtol=0, atol=0)


def test_adopt_keeps_tied_parameters_tied(mm: MemoryManager) -> None:
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    mm.adopt(model)
    assert model["head"].weight is model["emb"].weight
    assert len(mm.audit(["weights"]).records) == 1


def test_adopt_materialises_meta_modules(mm: MemoryManager) -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
    mm.adopt(model)
    assert model.weight.device.type == mm.backend.device.type
    model.weight.data.fill_(1.0)
    assert float(model.weight.detach().sum()) == 64 * 64


def test_zero_element_tensors(mm: MemoryManager) -> None:
    t = mm.empty((0, 4), torch.float32, "weights")
    assert t.shape == (0, 4)
    mm.sleep(level=1)
    mm.wake_up()
