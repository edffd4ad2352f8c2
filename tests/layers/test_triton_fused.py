"""The fused Triton kernels of the GPU path against the torch reference of each layer.

On the GPU: bf16 and fp32, against the reference run on the same device (``use_triton``
patched off). On the CPU: the same kernels through Triton's interpreter (float32 only; it
cannot emulate bf16), in a subprocess because ``TRITON_INTERPRET`` is read at import.
"""

from __future__ import annotations

import pytest
import torch

from dormant.layers import activation, attention, norm
from dormant.layers.activation import SiluAndMul
from dormant.layers.attention import write_kv_cache
from dormant.layers.norm import RMSNorm
from dormant.layers.rotary import RotaryEmbedding
from tests.triton_interpreter import run_interpreted

DTYPES = [torch.float32, torch.bfloat16]


def reference_qk(positions, qkv, num_q, num_kv, head_dim, norms):
    """What ``DecoderAttention`` computes on the CPU: per-head norms, then rotary."""
    rotary = RotaryEmbedding(head_dim, 512, 1e6).to(qkv.device)
    q, k, _ = qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    if norms is not None:
        q = norms[0](q.reshape(-1, num_q, head_dim)).reshape(q.shape)
        k = norms[1](k.reshape(-1, num_kv, head_dim)).reshape(k.shape)
    return rotary(positions, q, k), rotary.cos_sin_cache


def make_norm(size: int, dtype: torch.dtype, device: str, seed: int) -> RMSNorm:
    module = RMSNorm(size, 1e-6, dtype=dtype).to(device)
    generator = torch.Generator().manual_seed(seed)
    module.weight.data.copy_(1 + 0.1 * torch.randn(size, generator=generator))
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_silu_match_the_reference(dtype, monkeypatch) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 4096, device="cuda").to(dtype)
    residual = torch.randn(7, 4096, device="cuda").to(dtype)
    layer = make_norm(4096, dtype, "cuda", 0)
    gate_up = torch.randn(5, 2 * 3000, device="cuda").to(dtype)
    fused = (layer(x), *layer.add_and_norm(x, residual), SiluAndMul()(gate_up))
    monkeypatch.setattr(norm, "use_triton", lambda _: False)
    monkeypatch.setattr(activation, "use_triton", lambda _: False)
    expected = (layer(x), *layer.add_and_norm(x, residual), SiluAndMul()(gate_up))
    assert torch.equal(fused[2], expected[2])  # the residual sum: same rounding, exact
    for ours, reference in zip(fused, expected, strict=True):
        assert ours.dtype == reference.dtype and ours.shape == reference.shape
        torch.testing.assert_close(ours, reference)
        if dtype == torch.bfloat16:  # the sum order differs, which bf16 rounding hides
            mismatched = (ours != reference).float().mean()
            assert mismatched < 0.01, float(mismatched)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_norm", [False, True])
def test_fused_qk_norm_and_rotary_match_the_reference(dtype, has_norm) -> None:
    from dormant.layers.triton_rotary import rotate_qk_

    torch.manual_seed(0)
    num_q, num_kv, head_dim = 8, 2, 128
    qkv = torch.randn(9, (num_q + 2 * num_kv) * head_dim, device="cuda").to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 100, 101, 300, 511, 7], device="cuda")
    norms = None
    if has_norm:
        norms = (make_norm(head_dim, dtype, "cuda", 1), make_norm(head_dim, dtype, "cuda", 2))
    (q, k), cos_sin = reference_qk(positions, qkv, num_q, num_kv, head_dim, norms)
    fused = qkv.clone()
    norm_args = (norms[0].weight, norms[1].weight, 1e-6) if norms else None
    rotate_qk_(fused, positions, cos_sin, num_q, num_kv, head_dim, norm_args)
    torch.testing.assert_close(fused[:, : num_q * head_dim], q)
    torch.testing.assert_close(fused[:, num_q * head_dim : (num_q + num_kv) * head_dim], k)
    assert torch.equal(
        fused[:, (num_q + num_kv) * head_dim :], qkv[:, (num_q + num_kv) * head_dim :]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kv_write_matches_the_reference(cache_dtype) -> None:
    from dormant.layers.triton_kv_cache import write_kv_cache as triton_write

    torch.manual_seed(0)
    num_blocks, block_size, num_kv, head_dim = 16, 16, 4, 128
    qkv = torch.randn(6, 3 * num_kv * head_dim, device="cuda", dtype=torch.bfloat16)
    key = qkv[:, num_kv * head_dim : 2 * num_kv * head_dim].reshape(6, num_kv, head_dim)
    value = qkv[:, 2 * num_kv * head_dim :].reshape(6, num_kv, head_dim)  # strided views
    slots = torch.tensor([0, 17, 33, 250, 251, 100], device="cuda")
    scales = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
    shape = (2, num_blocks, block_size, num_kv, head_dim)
    expected = torch.zeros(shape, device="cuda").to(cache_dtype)
    ours = expected.clone()
    write_kv_cache(expected, key, value, slots, *scales)
    triton_write(ours, key, value, slots, *scales)
    assert torch.equal(ours.view(torch.uint8), expected.view(torch.uint8))


def test_attention_layer_picks_the_reference_on_the_cpu() -> None:
    cache = torch.zeros(2, 4, 16, 2, 128)
    assert not attention._use_triton_write(cache)
    assert not norm.use_triton(cache)


INTERPRETED = """
import torch
from dormant.layers.triton_activation import silu_and_mul
from dormant.layers.triton_kv_cache import write_kv_cache as triton_write
from dormant.layers.triton_norm import rms_norm
from dormant.layers.triton_rotary import rotate_qk_
from dormant.layers.activation import SiluAndMul
from dormant.layers.attention import write_kv_cache
from tests.layers.test_triton_fused import make_norm, reference_qk

torch.manual_seed(0)
x, residual = torch.randn(3, 96), torch.randn(3, 96)
layer = make_norm(96, torch.float32, "cpu", 0)
torch.testing.assert_close(rms_norm(x, layer.weight, 1e-6)[0], layer(x))
normed, summed = rms_norm(x, layer.weight, 1e-6, residual)
expected_normed, expected_summed = layer.add_and_norm(x, residual)
torch.testing.assert_close(normed, expected_normed)
assert torch.equal(summed, expected_summed)
gate_up = torch.randn(2, 2 * 70)
torch.testing.assert_close(silu_and_mul(gate_up), SiluAndMul()(gate_up))

head_dim = 32
for num_q, num_kv in ((4, 2), (8, 4)):  # one program per token; two, the second part-masked
    qkv = torch.randn(5, (num_q + 2 * num_kv) * head_dim)
    positions = torch.tensor([0, 3, 9, 200, 4])
    norms = tuple(make_norm(head_dim, torch.float32, "cpu", seed) for seed in (1, 2))
    (q, k), cos_sin = reference_qk(positions, qkv, num_q, num_kv, head_dim, norms)
    fused = qkv.clone()
    weights = (norms[0].weight, norms[1].weight, 1e-6)
    rotate_qk_(fused, positions, cos_sin, num_q, num_kv, head_dim, weights)
    torch.testing.assert_close(fused[:, : num_q * head_dim], q)
    torch.testing.assert_close(fused[:, num_q * head_dim : (num_q + num_kv) * head_dim], k)
    v_start = (num_q + num_kv) * head_dim
    assert torch.equal(fused[:, v_start:], qkv[:, v_start:])

key, value = torch.randn(2, 5, num_kv, head_dim).unbind(0)
slots = torch.tensor([0, 5, 17, 30, 31])
ours, expected = torch.zeros(2, 2, 2, 16, num_kv, head_dim).unbind(0)
scale = torch.tensor(1.0)
write_kv_cache(expected, key, value, slots, scale, scale)
triton_write(ours, key, value, slots, scale, scale)
assert torch.equal(ours, expected)

# One token: the batch-1 PDL knobs. The CPU has no PDL, so every choice runs the same kernel with
# USE_PDL off (the GPU runs the PDL code: tests/gpu/test_pdl_layer_chain.py); same bits.
from dormant.layers import triton_kv_cache, triton_norm, triton_rotary

def same(a, b):
    return all(torch.equal(s, t) for s, t in zip(a, b, strict=True))

x1, r1 = torch.randn(1, 96), torch.randn(1, 96)
plain_norm = rms_norm(x1, layer.weight, 1e-6, r1, pdl=False)
torch.testing.assert_close(plain_norm[0], layer.add_and_norm(x1, r1)[0])
qkv1 = torch.randn(1, (num_q + 2 * num_kv) * head_dim)
plain_qkv = qkv1.clone()
rotate_qk_(plain_qkv, positions[3:4], cos_sin, num_q, num_kv, head_dim, weights, pdl=False)
(q1, k1), _ = reference_qk(positions[3:4], qkv1, num_q, num_kv, head_dim, norms)
torch.testing.assert_close(plain_qkv[:, : num_q * head_dim], q1)
torch.testing.assert_close(plain_qkv[:, num_q * head_dim : v_start], k1)
plain_cache = torch.zeros(2, 2, 16, num_kv, head_dim)
triton_write(plain_cache, key[:1], value[:1], slots[2:3], scale, scale, pdl=False)
for knob in (False, True):
    triton_norm.USE_PDL_AT_BATCH_1 = triton_rotary.USE_PDL_AT_BATCH_1 = knob
    triton_kv_cache.USE_PDL_AT_BATCH_1 = knob
    for pdl in (None, True):
        assert same(rms_norm(x1, layer.weight, 1e-6, r1, pdl=pdl), plain_norm)
        rotated = qkv1.clone()
        rotate_qk_(rotated, positions[3:4], cos_sin, num_q, num_kv, head_dim, weights, pdl=pdl)
        assert torch.equal(rotated, plain_qkv)
        written = torch.zeros_like(plain_cache)
        triton_write(written, key[:1], value[:1], slots[2:3], scale, scale, pdl=pdl)
        assert torch.equal(written, plain_cache)
print("interpreted: ok")
"""


def test_kernels_through_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    result = run_interpreted(INTERPRETED)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreted: ok" in result.stdout
