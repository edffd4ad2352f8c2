"""Checks of the fused MoE router (``triton_router.py``), shared by the GPU tests
(tests/gpu/test_triton_moe.py) and the CPU ones through Triton's interpreter
(tests/layers/test_triton_router.py).

Two kinds of inputs:
- exact: x in {-1, 0, 1} and router weight rows of at most 32 entries in {-1, 1}, so every
  partial sum is an integer of at most 32 that float32, fp16 and bf16 all hold: the fused
  kernel's logits equal ``F.linear``'s whatever the summation order or split (ties included),
  and its weights and ids must be ``topk_softmax``'s on those logits bit for bit;
- random: the logits within a unit in the last place of the model dtype of ``F.linear``'s (in
  float32: 1e-5 of the largest, the sums' order), the
  routing bit for bit ``topk_softmax``'s on the kernel's own logits, and the ids
  ``select_experts``' on the reference logits for every token whose k-th and (k+1)-th
  probabilities are further apart than that unit can move them.
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


def _unit(reference_logits: torch.Tensor, dtype: torch.dtype) -> float:
    """How far the kernel's logits may be from ``F.linear``'s: float32, the sums' order;
    fp16/bf16, nearly equal sums rounded to adjacent values (one ulp at the largest)."""
    relative = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    return relative * float(reference_logits.abs().max())


def _clear_inputs(shape, dtype: torch.dtype, device: str):
    """Random inputs (the first of seeds 0, 1, ... where it holds) whose every token's k-th and
    (k+1)-th probabilities lie further apart than logits moved by ``_unit`` can close: there
    the ids cannot depend on the summation order."""
    _, num_experts, top_k, _ = shape
    for seed in range(20):
        x, w = random_inputs(shape, dtype, device, seed)
        reference_logits = F.linear(x, w).float()
        unit = _unit(reference_logits, dtype)
        probs = torch.softmax(reference_logits, dim=-1).sort(dim=-1, descending=True).values
        gap = probs[:, top_k - 1] - (probs[:, top_k] if top_k < num_experts else 0.0)
        if bool((gap > 4 * unit * probs[:, top_k - 1]).all()):  # dp <= p * 2 unit
            return x, w, reference_logits, unit
    raise AssertionError("no seed without a near tie: the check would prove nothing")


def check_random_routing(shape, dtype: torch.dtype, renormalize: bool, device: str) -> None:
    top_k = shape[2]
    x, w, reference_logits, unit = _clear_inputs(shape, dtype, device)
    weights, ids, logits = _route(x, w, top_k, renormalize)
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=unit)
    own_weights, own_ids = topk_softmax(logits, top_k, renormalize)
    assert torch.equal(ids, own_ids) and torch.equal(weights, own_weights)
    ref_weights, ref_ids = select_experts(reference_logits, top_k, renormalize)
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=4 * unit)


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
