"""Checks of the skinny GEMV (``triton_gemv.py``) that the Qwen3-MoE attention projections
run at decode sizes, shared by the GPU tests (tests/gpu/test_triton_moe.py) and the CPU ones
through Triton's interpreter (tests/layers/test_triton_gemv.py).

- exact: x and w in {-1, 0, 1}, at most 64 nonzero products per output, bias in {-1, 0, 1}:
  every partial sum is an integer below 2^7 that every dtype holds, so the result equals
  ``F.linear``'s bit for bit whatever the order of the sums;
- random: within the sums' order of ``F.linear`` (float32) or one unit in the last place of the
  output dtype (fp16, bf16).

The batch-1 PDL GEMV (``pdl_linear``) takes the same checks at one token, with its prefetch
shorter than, equal to and past the depth; and with PDL or without, the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dormant.layers.triton_gemv import GemvTiles, pdl_linear, skinny_linear

# (tokens, out, in): one to four tokens (and six: any M works), odd sizes, a partial row block
GEMV_SHAPES = [(1, 40, 64), (2, 33, 100), (3, 80, 48), (4, 24, 200), (6, 17, 40)]
ODD_TILES = GemvTiles(block_n=4, block_k=16, num_warps=2, num_stages=2)
PDL_GEMV_SHAPES = [(1, 40, 64), (1, 33, 100), (1, 24, 200)]
# a prefetch of a part of the depth, then a loop; the whole depth at once (no loop)
PDL_TILES = [GemvTiles(4, 16, 2, 2, prefetch_k=32), GemvTiles(8, 32, 2, 2, prefetch_k=256)]


def _inputs(shape, dtype: torch.dtype, device: str, is_exact: bool, seed: int = 0):
    num_tokens, n, k = shape
    generator = torch.Generator().manual_seed(seed)
    if is_exact:
        x = torch.randint(-1, 2, (num_tokens, k), generator=generator).float()
        order = torch.rand(n, k, generator=generator).argsort(dim=1)
        signs = torch.randint(0, 2, (n, k), generator=generator) * 2.0 - 1.0
        w = torch.where(order < min(64, k), signs, 0.0)
        bias = torch.randint(-1, 2, (n,), generator=generator).float()
    else:
        x = torch.randn(num_tokens, k, generator=generator)
        w = torch.randn(n, k, generator=generator) / k**0.5
        bias = torch.randn(n, generator=generator)
    return [t.to(device, dtype) for t in (x, w, bias)]


def check_exact(shape, dtype: torch.dtype, device: str) -> None:
    x, w, bias = _inputs(shape, dtype, device, is_exact=True)
    for b in (None, bias):
        reference = F.linear(x, w, b)
        for tiles in (None, ODD_TILES):
            ours = skinny_linear(x, w, b, tiles)
            assert ours.dtype == x.dtype and ours.shape == reference.shape
            assert torch.equal(ours, reference), (tiles, (ours - reference).abs().max())


def check_random(shape, dtype: torch.dtype, device: str) -> None:
    x, w, bias = _inputs(shape, dtype, device, is_exact=False)
    for b in (None, bias):
        reference = F.linear(x.float(), w.float(), None if b is None else b.float())
        ours = skinny_linear(x, w, b).float()
        scale = float(reference.abs().max())
        relative = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
        torch.testing.assert_close(ours, reference, rtol=0, atol=relative * scale)


def check_bad_inputs_raise(device: str) -> None:
    import pytest

    x, w, bias = _inputs((2, 8, 16), torch.float32, device, is_exact=False)
    with pytest.raises(ValueError, match="does not fit"):
        skinny_linear(x, w[:, :8])
    with pytest.raises(ValueError, match="does not fit"):
        skinny_linear(x, w.half())
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, bias[:4])
    with pytest.raises(ValueError, match="unit stride"):
        skinny_linear(x.t().contiguous().t(), w)


def check_pdl_gemv(shape, dtype: torch.dtype, device: str) -> None:
    """``pdl_linear`` on exact inputs: ``F.linear``'s bits, at every tile, with PDL or not; on
    random ones within ``check_random``'s bound, and the same bits with PDL as without."""
    x, w, bias = _inputs(shape, dtype, device, is_exact=True)
    for b in (None, bias):
        reference = F.linear(x, w, b)
        for tiles in (None, *PDL_TILES):
            for pdl in (False, True):
                ours = pdl_linear(x, w, b, tiles, pdl=pdl)
                assert ours.dtype == x.dtype and ours.shape == reference.shape
                assert torch.equal(ours, reference), (tiles, pdl)
    x, w, bias = _inputs(shape, dtype, device, is_exact=False)
    for b in (None, bias):
        reference = F.linear(x.float(), w.float(), None if b is None else b.float())
        for tiles in (None, *PDL_TILES):
            ours = pdl_linear(x, w, b, tiles, pdl=True)
            assert torch.equal(ours, pdl_linear(x, w, b, tiles, pdl=False)), tiles
            scale = float(reference.abs().max())
            relative = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
            torch.testing.assert_close(ours.float(), reference, rtol=0, atol=relative * scale)


def check_pdl_gemv_bad_inputs_raise(device: str) -> None:
    import pytest

    x, w, bias = _inputs((1, 8, 16), torch.float32, device, is_exact=False)
    with pytest.raises(ValueError, match="one token"):
        pdl_linear(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match="does not fit"):
        pdl_linear(x, w[:, :8])
    with pytest.raises(ValueError, match="bias"):
        pdl_linear(x, w, bias[:4])
