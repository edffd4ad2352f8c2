"""The MoE router at decode sizes in one kernel: the router GEMV, softmax, top-k and the
``norm_topk_prob`` renormalisation (``router_topk``).

Unfused, a decode step's routing is two launches: cuBLAS's GEMV for ``x @ gate.T`` (0.5 MB at
Qwen3-30B-A3B's 128 x 2048: pure latency, 5.1 us on the H200) and ``topk_softmax`` (3.9 us).
Here the experts are split across programs; each computes its block's logits over the whole
hidden size for every token, and the last program to finish routes every token:

| phase           | run by                      | does                                          |
|-----------------|-----------------------------|-----------------------------------------------|
| GEMV            | every program               | logits[t, e] of its ``block_e`` experts for    |
|                 |                             | every token t: a float32 sum rounded to the   |
|                 |                             | model dtype (the reference GEMM's output),    |
|                 |                             | stored as float32                             |
| ticket          | every program               | a CTA barrier (its logits are out), then      |
|                 |                             | ``atomic_add(ticket, 1)``, acq_rel, GPU scope |
| softmax + top-k | the one that drew           | ``softmax_topk_row`` per token (what          |
|                 | ``num_programs - 1``        | ``topk_softmax`` runs), then ticket = 0       |

The ticket (``new_router_ticket``) is one int32 that is 0 between launches: the last program
sets it back, so it needs no memset per call and is graph-safe. It is persistent state of the
layer (a ``runtime`` buffer: restored bit-exact by every sleep level; a DISCARD tag would hand
back garbage and the kernel would never route). Precondition: two launches with one ticket never
run at the same time (one ticket per layer, one stream per model).

Numerics: the same rounding points as the reference (logits in the model dtype, then float32
softmax/top-k). Given the same logits, the weights and ids are ``topk_softmax``'s bit for bit
(one shared function, and on the GPU the same layout of the logits, one warp with 4 a thread, so
the same order of the sums: tests/layers/test_triton_moe_compile.py). The GEMV sums in another
order than cuBLAS, so a logit can differ from ``F.linear``'s by one unit of the model dtype's
last place; where that reorders experts whose probabilities tie to within it, an id can differ;
the returned logits say what was routed on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dormant.layers.triton_moe_routing import softmax_topk_row
from dormant.layers.triton_pdl import use_pdl

# Tokens up to this take the fused router (``is_router_fused``); more take cuBLAS's GEMM and
# ``topk_softmax``: every program re-reads its weight block once per token, so the fused GEMV
# is for decode sizes. 4 matches the direct experts' 32 pairs at top-8.
FUSED_ROUTER_MAX_TOKENS = 4
_TARGET_PROGRAMS = 128  # about one per SM on the H200 (132): the weights stream in one wave
_TILE = 2048  # weights per program and step
# Launch with programmatic dependent launch (triton_pdl.py), as the direct experts do: the
# router's weights load while the kernel before it (the RMSNorm) ends. Measured by
# benchmarks/moe_b1_sweep.py on the H200: the norm -> router -> experts chain 38.7 -> 36.7 us
# with the router's PDL alone, bit-exact (results/2026-12-02d-run3-moe-b1-sweep.jsonl).
USE_PDL = True


@dataclass(frozen=True)
class RouterConfig:
    """``block_e`` experts per program, ``block_k`` of the hidden size per step."""

    block_e: int
    block_k: int


def is_router_fused(num_tokens: int) -> bool:
    """Whether a layer routes a batch of ``num_tokens`` with ``router_topk``."""
    return 0 < num_tokens <= FUSED_ROUTER_MAX_TOKENS


def router_config(num_experts: int, hidden: int) -> RouterConfig:
    """About ``_TARGET_PROGRAMS`` programs (128 experts: one each), and ``_TILE`` weights a
    step: a whole 4 KB row of Qwen3-30B-A3B (2048 bf16), so each program issues all its loads
    at once (64 per thread of its one warp: more spills registers, ptxas for sm_90)."""
    block_e = triton.next_power_of_2(triton.cdiv(num_experts, _TARGET_PROGRAMS))
    return RouterConfig(block_e, max(16, min(_TILE // block_e, triton.next_power_of_2(hidden))))


def new_router_ticket(device: torch.device | str | None = None) -> torch.Tensor:
    """A layer's ticket: int32 ``[1]``, zero (what every launch leaves it at)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@triton.jit
def _router_topk_kernel(
    x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, ticket_ptr,
    num_experts, hidden, stride_x, stride_w,
    NUM_TOKENS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    EXPERTS_PAD: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    is_expert = experts < num_experts
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + experts[:, None].to(tl.int64) * stride_w
    if USE_PDL:  # the first step's weights load before the wait on x's kernel (triton_pdl.py)
        w_mask = is_expert[:, None] & (ks < hidden)[None, :]
        w_first = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0)  # held in the dtype
        gdc_wait()
        gdc_launch_dependents()  # gate/up's programs may launch: they wait for our ids
    dtype = x_ptr.dtype.element_ty
    for token in tl.static_range(NUM_TOKENS):
        x_row = x_ptr + token * stride_x
        acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
        if USE_PDL:  # the loop's first step, on the weights loaded already: the same sums
            x = tl.load(x_row + ks, mask=ks < hidden, other=0.0).to(tl.float32)
            acc += w_first.to(tl.float32) * x[None, :]
        for first in range(BLOCK_K if USE_PDL else 0, hidden, BLOCK_K):
            is_k = ks < hidden - first
            x = tl.load(x_row + first + ks, mask=is_k, other=0.0).to(tl.float32)
            w = tl.load(w_rows + first + ks[None, :], mask=is_expert[:, None] & is_k[None, :],
                        other=0.0)  # fmt: skip
            acc += w.to(tl.float32) * x[None, :]
        logits = tl.sum(acc, axis=1).to(dtype).to(tl.float32)  # the GEMM's output dtype
        tl.store(logits_ptr + token * num_experts + experts, logits, mask=is_expert)
    tl.debug_barrier()  # every thread's logits are stored before the ticket is drawn
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:  # the others' logits are out: route every token
        for token in tl.static_range(NUM_TOKENS):
            softmax_topk_row(
                logits_ptr + token * num_experts, weights_ptr + token * TOP_K,
                ids_ptr + token * TOP_K, num_experts, EXPERTS_PAD, TOP_K, TOP_K_PAD,
                RENORMALIZE, CACHE=".cg",  # from L2: this SM's L1 never held them
            )  # fmt: skip
        tl.store(ticket_ptr, 0)  # every other program has drawn: the next launch starts at 0


def router_topk(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    ticket: torch.Tensor,
    config: RouterConfig | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``select_experts(x @ gate_weight.T, top_k, renormalize)`` in one kernel: ``x [T, H]``,
    ``gate_weight [E, H]`` (one dtype, unit stride in H), ``ticket`` a zero int32 ``[1]`` of
    this layer (``new_router_ticket``) → float32 weights and int32 ids ``[T, top_k]`` in
    descending probability, and the float32 logits ``[T, E]`` they were routed on (the model
    dtype's values). ``config`` overrides ``router_config``'s tiles and ``pdl`` ``USE_PDL`` (off
    where the device has no PDL), for tuning. No host sync.
    """
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if gate_weight.shape[1] != hidden or gate_weight.dtype != x.dtype:
        raise ValueError(
            f"router weight {tuple(gate_weight.shape)} {gate_weight.dtype} does not fit "
            f"x {tuple(x.shape)} {x.dtype}: it must be [num_experts, {hidden}] in {x.dtype}"
        )
    if x.stride(1) != 1 or gate_weight.stride(1) != 1:
        raise ValueError("router_topk needs unit stride in the hidden dimension of x and gate")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if ticket.dtype != torch.int32 or ticket.numel() != 1 or ticket.device != x.device:
        raise ValueError("ticket must be this layer's int32 [1] (new_router_ticket) on x's device")
    device = x.device
    logits = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=device)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids, logits
    tiles = config or router_config(num_experts, hidden)
    is_pdl = use_pdl(pdl, USE_PDL, device)
    experts_pad = triton.next_power_of_2(num_experts)
    # One warp up to 256 experts, as topk_softmax: its top-k is then warp shuffles alone, and
    # a program's 4 KB of weights is 8 x 16-byte loads per thread, all in flight at once.
    _router_topk_kernel[(triton.cdiv(num_experts, tiles.block_e),)](
        x, gate_weight, logits, weights, ids, ticket, num_experts, hidden, x.stride(0),
        gate_weight.stride(0), NUM_TOKENS=num_tokens, BLOCK_E=tiles.block_e,
        BLOCK_K=tiles.block_k, EXPERTS_PAD=experts_pad, TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, USE_PDL=is_pdl,
        num_warps=1 if experts_pad <= 256 else 4, launch_pdl=is_pdl,
    )  # fmt: skip
    return weights, ids, logits
