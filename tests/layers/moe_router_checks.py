"""Checks of the fused MoE router (``triton_router.py``), shared by the GPU tests
(tests/gpu/test_triton_moe.py) and the CPU ones through Triton's interpreter
(tests/layers/test_triton_router.py).

Two kinds of inputs:
- exact: x in {-1, 0, 1} and router weight rows of at most 32 entries in {-1, 1}, so every
  partial sum is an integer of at most 32 that float32, fp16 and bf16 all hold: the fused
  kernel's logits equal ``F.linear``'s whatever the summation order or split (ties included),
  and its weights and ids must be ``topk_softmax``'s on those logits bit for bit;
- random: the logits within a unit of the exact (float32) products (fp16/bf16: an ulp at the
  largest; float32: 1e-5 of it), the routing bit for bit ``topk_softmax``'s on the kernel's
  own logits, and the ids ``select_experts``' on cuBLAS's logits (today's routing) for every
  token whose k-th and (k+1)-th logits are further apart than the two computations can differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dormant.layers.moe_reference import select_experts
from dormant.layers.triton_moe_routing import topk_softmax
from dormant.layers.triton_router import RouterConfig, new_router_ticket, router_topk

# (tokens, experts, top_k, hidden): Qwen3-30B-A3B's routing (128 experts, top-8) on a small
# hidden size, and tiny ones with odd sizes (a partial expert block, a masked k tail)
ROUTER_SHAPES = [(1, 128, 8, 64), (4, 128, 8, 64), (1, 8, 2, 40), (2, 12, 3, 33), (3, 6, 1, 48),
                 (4, 16, 4, 64)]  # fmt: skip
ODD_TILES = RouterConfig(block_e=4, block_k=16)  # several programs' experts, many k steps


def exact_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0):
    num_tokens, num_experts, _, hidden = shape
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (num_tokens, hidden), generator=generator).float()
    signs = torch.randint(0, 2, (num_experts, hidden), generator=generator) * 2.0 - 1.0
    order = torch.rand(num_experts, hidden, generator=generator).argsort(dim=1)
    w = torch.where(order < min(32, hidden // 2), signs, 0.0)  # 32 (or H / 2) per row
    return x.to(device, dtype), w.to(device, dtype)


def random_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0):
    num_tokens, num_experts, _, hidden = shape
    generator = torch.Generator(device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator, device=device)
    w = torch.randn(num_experts, hidden, generator=generator, device=device) / hidden**0.5
    return x.to(dtype), w.to(dtype)


def _route(x, w, top_k: int, renormalize: bool, config: RouterConfig | None = None):
    ticket = new_router_ticket(x.device)
    weights, ids, logits = router_topk(x, w, top_k, renormalize, ticket, config)
    assert int(ticket) == 0, "the last program leaves the ticket at zero"
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (x.shape[0], top_k)
    assert logits.dtype == torch.float32 and logits.shape == (x.shape[0], w.shape[0])
    return weights, ids, logits


def check_exact_routing(shape, dtype: torch.dtype, renormalize: bool, device: str) -> None:
    """Bit for bit ``topk_softmax`` on ``F.linear``'s logits, at the default and odd tiles."""
    x, w = exact_inputs(shape, dtype, device)
    reference_logits = F.linear(x, w).float()
    ref_weights, ref_ids = topk_softmax(reference_logits, shape[2], renormalize)
    for config in (None, ODD_TILES):
        weights, ids, logits = _route(x, w, shape[2], renormalize, config)
        assert torch.equal(logits, reference_logits), (config, logits - reference_logits)
        assert torch.equal(ids, ref_ids), (config, ids, ref_ids)
        assert torch.equal(weights, ref_weights), (config, weights - ref_weights)


def _unit(exact_logits: torch.Tensor, dtype: torch.dtype) -> float:
    """How far a computed logit may be from the exact one: float32, the sums' order (1e-5 of
    the largest); fp16/bf16, one rounding (an ulp at the largest)."""
    relative = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    return relative * float(exact_logits.abs().max())


def _inputs_with_a_clear_token(shape, dtype: torch.dtype, device: str):
    """Random inputs (the first of seeds 0, 1, ... where one exists) with at least one token
    whose k-th and (k+1)-th logits (cuBLAS's, as routed today) lie more than 4 units apart:
    the kernel's and cuBLAS's logits are each within a unit of the exact ones, so there the ids
    cannot depend on either's summation order. Returns x, w, today's logits, the unit and
    which tokens are clear."""
    _, num_experts, top_k, _ = shape
    for seed in range(64):
        x, w = random_inputs(shape, dtype, device, seed)
        unit = _unit(F.linear(x.float(), w.float()), dtype)
        today = F.linear(x, w).float()
        if top_k == num_experts:
            return x, w, today, unit, torch.ones(shape[0], dtype=torch.bool, device=device)
        top = today.topk(top_k + 1, dim=-1).values
        is_clear = top[:, top_k - 1] - top[:, top_k] > 4 * unit
        if bool(is_clear.any()):
            return x, w, today, unit, is_clear
    raise AssertionError("every token of every seed is a near tie: the check would prove nothing")


def check_random_routing(shape, dtype: torch.dtype, renormalize: bool, device: str) -> None:
    """The logits within a unit of the exact ones; the routing bit for bit ``topk_softmax`` on
    them; on the clear tokens, today's ids (``select_experts`` on cuBLAS's logits) and weights
    within the units."""
    top_k = shape[2]
    x, w, today, unit, is_clear = _inputs_with_a_clear_token(shape, dtype, device)
    weights, ids, logits = _route(x, w, top_k, renormalize)
    exact = F.linear(x.float(), w.float())
    torch.testing.assert_close(logits, exact, rtol=0, atol=unit)
    own_weights, own_ids = topk_softmax(logits, top_k, renormalize)
    assert torch.equal(ids, own_ids) and torch.equal(weights, own_weights)
    ref_weights, ref_ids = select_experts(today, top_k, renormalize)
    # The same experts; two whose bf16 logits tie within the GEMV's unit may come in either
    # order (the H200, 2026-12-02c run 6), which changes nothing the experts compute: compare
    # by expert id.
    ids, weights = _by_id(ids[is_clear], weights[is_clear])
    ref_ids, ref_weights = _by_id(ref_ids[is_clear], ref_weights[is_clear])
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    # a probability moves by at most p * (e^(2 units) - 1): 4 units covers both roundings
    torch.testing.assert_close(weights, ref_weights, rtol=8 * unit, atol=1e-6)


def _by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), weights.gather(-1, order)


def check_nan_rows_route_to_real_experts(device: str) -> None:
    """A NaN in x (a broken activation) still picks top_k distinct experts in range."""
    x, w = random_inputs((3, 8, 3, 32), torch.float32, device)
    x[1, 5] = float("nan")
    _, ids, _ = _route(x, w, 3, True)
    assert bool(((ids >= 0) & (ids < 8)).all())
    assert all(len(set(row.tolist())) == 3 for row in ids.cpu())


def check_bad_inputs_raise(device: str) -> None:
    import pytest

    x, w = random_inputs((1, 8, 2, 32), torch.float32, device)
    ticket = new_router_ticket(device)
    with pytest.raises(ValueError, match="does not fit"):
        router_topk(x, w[:, :16], 2, True, ticket)
    with pytest.raises(ValueError, match="does not fit"):
        router_topk(x, w.half(), 2, True, ticket)
    with pytest.raises(ValueError, match="top_k"):
        router_topk(x, w, 9, True, ticket)
    with pytest.raises(ValueError, match="ticket"):
        router_topk(x, w, 2, True, ticket.long())
    with pytest.raises(ValueError, match="unit stride"):
        router_topk(x, w.t().contiguous().t(), 2, True, ticket)
    assert int(ticket) == 0
