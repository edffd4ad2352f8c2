"""The mixture-of-experts computation in torch: the reference the Triton kernels are checked
against, run on the CPU, and on the GPU with ``DORMANT_TRITON=0``.

The arithmetic, with its rounding points (the Triton path keeps the same ones; Hugging Face's
``Qwen3MoeSparseMoeBlock`` computes the same values, summing in the model dtype instead):

| step             | computes                                       | in                     |
|------------------|------------------------------------------------|------------------------|
| router           | ``logits = x @ gate.T``                        | model dtype (GEMM)     |
| routing          | ``softmax(logits)``, top-k, renormalised if asked | float32             |
| pair (t, j) of e | ``h = silu(x_t @ w1_e.T) * (x_t @ w3_e.T)``    | model dtype, each op   |
|                  | ``y = (h @ w2_e.T) * weight_tj``               | model dtype, each op   |
| combine          | ``out_t = sum_j y_tj``                         | float32, rounded once  |

Layouts: ``w13 [E, 2 * I, H]`` (each expert's gate rows, then its up rows), ``w2 [E, H, I]``;
``topk_ids`` int32 ``[T, k]`` and ``topk_weights`` float32 ``[T, k]``; pair ``p = t * k + j``.

Two forms, one result:
- on the CPU, grouped over the pairs sorted by expert: each expert multiplies only its own
  tokens (the group sizes are read on the host: there are no graphs on the CPU);
- on a GPU, a loop over every expert that multiplies every token and weights the tokens not
  routed to it by zero: no host sync and fixed shapes, so it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def select_experts(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """``[T, E]`` logits → float32 weights and int32 expert ids, ``[T, top_k]`` each, in
    descending probability. No host sync."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def expert_mlp(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """One expert, ``x [n, H]`` → ``[n, H]``, rounding in the model dtype after each op."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def fused_experts_reference(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor
) -> Tensor:
    """``x [T, H]`` → ``[T, H]``: the weighted sum over each token's experts (the arithmetic
    of the module table). Under tensor parallelism the result is this rank's partial sum."""
    if x.is_cuda:
        return _every_expert(x, w13, w2, topk_weights, topk_ids)
    return _grouped_by_expert(x, w13, w2, topk_weights, topk_ids)


def _grouped_by_expert(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor
) -> Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # host sync (CPU only)
    pair_weights = topk_weights.reshape(-1).to(x.dtype)
    y = torch.empty((num_tokens * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    for expert, pairs in enumerate(order.split(counts)):
        if pairs.numel() == 0:
            continue
        out = expert_mlp(x[pairs // top_k], w13[expert], w2[expert])
        y[pairs] = out * pair_weights[pairs, None]
    return _combine(y, num_tokens, top_k)


def _every_expert(
    x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor
) -> Tensor:
    num_tokens, top_k = topk_ids.shape
    y = torch.zeros((num_tokens, top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    weights = topk_weights.to(x.dtype)
    for expert in range(w13.shape[0]):
        is_routed = topk_ids == expert  # [T, k]: at most one slot per token
        out = expert_mlp(x, w13[expert], w2[expert])
        contribution = out[:, None, :] * weights[:, :, None]
        y = torch.where(is_routed[:, :, None], contribution, y)
    return _combine(y.reshape(num_tokens * top_k, -1), num_tokens, top_k)


def _combine(y: Tensor, num_tokens: int, top_k: int) -> Tensor:
    """Pair outputs ``[T * k, H]`` → ``[T, H]``: summed over each token's slots in float32."""
    return y.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(y.dtype)
