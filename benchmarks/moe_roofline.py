"""What a MoE decode step reads, for ``benchmarks/moe.py``'s roofline, and its inputs.

    part         bytes read by one decode step of ``batch`` sequences with ``context`` cached
    ───────────  ─────────────────────────────────────────────────────────────────────────────
    experts      per sparse layer: (experts its tokens routed to) x (w13 + w2 of one expert)
    dense        every other parameter (attention, router, norms, LM head), once
    embedding    one row per sequence
    kv           per sequence: (context + 1) positions x layers x (k + v) x kv heads x head_dim

The routed experts are counted from the step's own routing (the router's logits of an eager
run of the same inputs), not assumed: random weights route close to uniformly, so batch 64
touches most of the 128 experts of a layer, batch 1 exactly 8.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks.decode import decode_step as dense_decode_step
from benchmarks.decode import time_steps
from dormant import SamplingParams
from dormant.core.step_input import StepInput
from dormant.layers.moe import FusedMoE
from dormant.layers.moe_reference import select_experts
from dormant.models import CausalLM
from dormant.models.qwen3_moe import SparseMoeBlock
from dormant.worker.worker import Worker

__all__ = ["count_routed_experts", "decode_step", "fill_kv_cache", "step_bytes", "time_steps"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def decode_step(batch_size: int, context: int, block_size: int, num_kv_blocks: int) -> StepInput:
    """``benchmarks/decode.py``'s decode step (each sequence the blocks its context needs, of the
    ``num_kv_blocks`` the cache holds; raises when the batch does not fit), with a different
    token per sequence, so the sequences route differently."""
    step = dense_decode_step(batch_size, context, block_size, num_kv_blocks, GREEDY)
    seqs = tuple(
        replace(seq, token_ids=(1000 + 7919 * i % 100000,)) for i, seq in enumerate(step.seqs)
    )
    return replace(step, seqs=seqs)


@torch.no_grad()
def fill_kv_cache(model: CausalLM) -> None:
    """Finite random keys and values in every slot (the engine leaves them uninitialised)."""
    for layer in model.attention_layers():
        cache = layer.checked_cache()
        generator = torch.Generator(device=cache.device).manual_seed(layer.layer_idx)
        if cache.element_size() >= 2:
            cache.normal_(0.0, 1.0, generator=generator)
        else:  # fp8: written through a wider buffer, one block at a time
            for block in cache.unbind(1):
                noise = torch.randn(block.shape, device=cache.device, generator=generator)
                block.copy_(noise)


def count_routed_experts(worker: Worker, step: StepInput) -> list[int]:
    """Per sparse layer, the experts the step's real tokens route to (an eager run, hooked)."""
    counts: list[int] = []
    num_seqs = len(step.seqs)

    def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        # the sparse layer, not its experts: decode batches route in the fused router
        # (layers/triton_router.py), so the experts never see the logits
        assert isinstance(module, SparseMoeBlock)
        logits = module.gate(inputs[0][:num_seqs])
        _, ids = select_experts(logits, module.experts.top_k, module.experts.renormalize)
        counts.append(int(torch.unique(ids).numel()))

    moe_layers = [m for m in worker.model.modules() if isinstance(m, SparseMoeBlock)]
    handles = [m.register_forward_pre_hook(hook) for m in moe_layers]
    runner = worker.runner
    graphs, runner.graphs = runner.graphs, None  # eager, so the hooks run
    try:
        worker.execute(step)
    finally:
        runner.graphs = graphs
        for handle in handles:
            handle.remove()
    assert len(counts) == len(moe_layers)
    return counts


def step_bytes(
    model: CausalLM, batch_size: int, context: int, routed_experts: list[int]
) -> dict[str, int]:
    """The bytes one decode step reads, by part (the module table), and their total."""
    parts = {"experts": 0, "dense": 0, "embedding": 0, "kv": 0}
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        if ".experts." in name:
            continue
        if "embed_tokens" in name:
            parts["embedding"] += batch_size * param.shape[1] * param.element_size()
        else:
            parts["dense"] += nbytes
    moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for layer, count in zip(moe_layers, routed_experts, strict=True):
        per_expert = layer.w13_weight[0].numel() + layer.w2_weight[0].numel()
        parts["experts"] += count * per_expert * layer.w13_weight.element_size()
    for attention in model.attention_layers():
        cache = attention.checked_cache()
        per_position = 2 * attention.num_kv_heads * attention.head_dim * cache.element_size()
        parts["kv"] += batch_size * (context + 1) * per_position
    return {**parts, "total": sum(parts.values())}
