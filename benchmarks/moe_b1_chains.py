"""The chains and variants ``benchmarks/moe_b1_sweep.py`` times: Qwen3-30B-A3B's batch-1 decode
kernels on random bf16 weights, each layer its own weights (so L2 does not serve a later layer).

A ``Variant`` is the keyword arguments the chain passes its kernels; ``Chain.default`` is the
one that uses the modules' defaults (no arguments), so the first row of each group is what the
engine runs today. ``Chain.reference`` is what a variant's replay is checked against: the
default, except in the "layer" group, where each variant is checked against its own kernels
launched plainly (its PDL GEMV sums in another order than cuBLAS, which can flip a routing id
over the chained layers; the same kernels with and without PDL must give the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dormant.layers.attention import new_merge_tickets
from dormant.layers.context import AttentionMetadata
from dormant.layers.rotary import RotaryEmbedding
from dormant.layers.triton_attention import paged_decode_attention
from dormant.layers.triton_gemv import GemvTiles, pdl_linear
from dormant.layers.triton_kv_cache import write_kv_cache
from dormant.layers.triton_moe_direct import GemvConfig, fused_experts_direct
from dormant.layers.triton_norm import rms_norm
from dormant.layers.triton_rotary import rotate_qk_
from dormant.layers.triton_router import new_router_ticket, router_topk

HIDDEN, NUM_EXPERTS, TOP_K, INTER = 2048, 128, 8, 768
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
CONTEXT, MAX_MODEL_LEN = 512, 1024  # benchmarks/moe.py's graphs plan for max_model_len
MOE_LAYERS, ATTENTION_LAYERS, LAYER_LAYERS = 12, 96, 12
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Variant:
    """``options``: (keyword, value) pairs for the chain's kernels; none is the default."""

    name: str
    options: tuple[tuple[str, object], ...] = ()

    def kwargs(self, *keys: str) -> dict[str, Any]:
        """The options among ``keys`` that this variant sets."""
        return {key: value for key, value in self.options if key in keys}

    @property
    def is_pdl(self) -> bool:
        return any(key.endswith("pdl") and bool(value) for key, value in self.options)

    @property
    def knobs(self) -> dict[str, str]:
        return {key: str(value) for key, value in self.options}


class Chain:
    """A group's layers: ``run`` launches every layer's kernels and returns their outputs;
    ``refill`` writes fresh random inputs in place (a captured graph reads them)."""

    name: str
    num_layers: int
    variants: list[Variant]

    @property
    def default(self) -> Variant:
        return self.variants[0]

    def run(self, variant: Variant) -> list[torch.Tensor]:
        raise NotImplementedError

    def refill(self, seed: int) -> None:
        raise NotImplementedError

    def reference(self, variant: Variant) -> Variant:
        """What ``variant``'s replay is checked against (run eagerly on the same inputs)."""
        return self.default


def _randn(generator: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, device=DEVICE, dtype=DTYPE) * scale


Options = tuple[tuple[str, object], ...]
# gemv_config's defaults at these shapes: "tile-all"'s gate/up and down (the defaults since the
# sixteenth session's run 1); the loop gate/up and down (block_k 256)
UP_TILE, TILE = GemvConfig(1, HIDDEN, num_warps=2), GemvConfig(1, 1024)
UP, DOWN = GemvConfig(16, 256), GemvConfig(4, 256)
# "tile-all"'s gate/up tiles, (block_n, warps), around its default (1, 2): run 1 measured
# (4, 4) 32.1, (2, 4) 31.3, (4, 8) 31.2, (8, 8) 36.2, (2, 2) 30.1, (1, 2) 29.2 us a layer
TILE_UP = [(1, 1), (2, 2), (1, 4), (2, 1)]
# "tile-all"'s down tiles around its default (1, 4); run 2 measured (2, 4) +0.2 / +0.8 us a
# layer (moe / layer chain), (1, 2) -0.7 / -, (2, 2) +4.9 / -
TILE_DOWN = [(2, 4), (1, 2)]  # (block_n, warps)
NO_PDL: Options = (("router_pdl", False), ("pdl", False))
FIFTEENTH: Options = (("kernels", "tile"), ("configs", (UP, GemvConfig(2, 1024))))


def _moe_variants() -> list[Variant]:
    """The defaults first ("tile-all" with PDL); then the fifteenth session's ("tile"), the loop
    kernels, "tile-all" without PDL; then "tile-all"'s gate/up and down tiles, with PDL."""
    loop: Options = (("kernels", "loop"), ("configs", (UP, DOWN)))
    variants = [
        Variant("tile-all +pdl (default)"),
        Variant("tile +pdl (fifteenth session)", FIFTEENTH),
        Variant("loop", loop + NO_PDL),
        Variant("loop +pdl", loop),
        Variant("tile-all", NO_PDL),
    ]
    for n, warps in TILE_UP:
        tiles = (GemvConfig(n, HIDDEN, warps), TILE)
        variants.append(Variant(f"tile-all +pdl up({n},{warps})", (("configs", tiles),)))
    for n, warps in TILE_DOWN:  # block_k unused: the tile kernels take the whole depth
        tiles = (UP_TILE, GemvConfig(n, 1024, warps))
        variants.append(Variant(f"tile-all +pdl down({n},{warps})", (("configs", tiles),)))
    return variants


class MoeChain(Chain):
    """Per layer: the post-attention RMSNorm (with its residual), the fused router, the experts:
    what the model launches between the attention's o_proj and the next layer's norm."""

    name, num_layers = "moe", MOE_LAYERS

    def __init__(self) -> None:
        generator = torch.Generator(DEVICE).manual_seed(0)
        layers = range(self.num_layers)
        self.w13 = [_randn(generator, NUM_EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
                    for _ in layers]  # fmt: skip
        self.w2 = [_randn(generator, NUM_EXPERTS, HIDDEN, INTER, scale=INTER**-0.5) for _ in layers]
        self.gate = [_randn(generator, NUM_EXPERTS, HIDDEN, scale=HIDDEN**-0.5) for _ in layers]
        self.norm = [1 + _randn(generator, HIDDEN, scale=0.1) for _ in layers]
        self.tickets = [new_router_ticket(DEVICE) for _ in layers]
        self.x = [_randn(generator, 1, HIDDEN) for _ in layers]
        self.residual = [_randn(generator, 1, HIDDEN) for _ in layers]
        self.variants = _moe_variants()

    def run(self, variant: Variant) -> list[torch.Tensor]:
        outputs = []
        for layer in range(self.num_layers):
            normed, _ = rms_norm(self.x[layer], self.norm[layer], 1e-6, self.residual[layer])
            router_pdl = variant.kwargs("router_pdl").get("router_pdl")
            weights, ids, _ = router_topk(normed, self.gate[layer], TOP_K, True,
                                          self.tickets[layer], pdl=router_pdl)  # fmt: skip
            out = fused_experts_direct(
                normed,
                self.w13[layer],
                self.w2[layer],
                weights,
                ids,
                **variant.kwargs("configs", "kernels", "pdl"),
            )
            outputs += [ids, out]
        return outputs

    def refill(self, seed: int) -> None:
        generator = torch.Generator(DEVICE).manual_seed(seed)
        for tensor in (*self.x, *self.residual):
            tensor.copy_(_randn(generator, *tensor.shape))


class AttentionChain(Chain):
    """Per layer: the new token's KV written, then the decode attention over 513 positions."""

    name, num_layers = "attention", ATTENTION_LAYERS

    def __init__(self) -> None:
        generator = torch.Generator(DEVICE).manual_seed(1)
        num_blocks = MAX_MODEL_LEN // BLOCK_SIZE
        layers = range(self.num_layers)
        shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.kv = [_randn(generator, *shape) for _ in layers]
        self.q = [_randn(generator, 1, NUM_HEADS, HEAD_DIM) for _ in layers]
        self.k = [_randn(generator, 1, NUM_KV_HEADS, HEAD_DIM) for _ in layers]
        self.v = [_randn(generator, 1, NUM_KV_HEADS, HEAD_DIM) for _ in layers]
        self.unit_scale = torch.ones((), dtype=torch.float32, device=DEVICE)
        self.merge_tickets = [new_merge_tickets(DEVICE) for _ in layers]
        tables = torch.arange(num_blocks, dtype=torch.int32, device=DEVICE)[None]
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor([CONTEXT], dtype=torch.int64, device=DEVICE),
            block_tables=tables,
            seq_lens=torch.tensor([CONTEXT + 1], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            max_query_len=1,
            max_seq_len=MAX_MODEL_LEN,
        )
        self.variants = [Variant("planned +pdl (default)"), Variant("planned", (("pdl", False),))]
        self.variants += [Variant(f"splits {n} +pdl", (("wanted_splits", n),)) for n in (16, 8)]
        # the merge in a kernel of its own, as before the merge tickets (twelfth session)
        self.variants.append(Variant("planned +pdl, merge kernel", (("merge_kernel", True),)))

    def run(self, variant: Variant) -> list[torch.Tensor]:
        outputs = []
        for layer in range(self.num_layers):
            write_kv_cache(self.kv[layer], self.k[layer], self.v[layer], self.meta.slot_mapping,
                           self.unit_scale, self.unit_scale)  # fmt: skip
            is_merge_kernel = variant.kwargs("merge_kernel").get("merge_kernel", False)
            outputs.append(paged_decode_attention(
                self.q[layer], self.kv[layer], self.meta, HEAD_DIM**-0.5, self.unit_scale,
                self.unit_scale, tickets=None if is_merge_kernel else self.merge_tickets[layer],
                **variant.kwargs("wanted_splits", "pdl"),
            ))  # fmt: skip
        return outputs

    def refill(self, seed: int) -> None:
        generator = torch.Generator(DEVICE).manual_seed(seed)
        for tensor in (*self.q, *self.k, *self.v):
            tensor.copy_(_randn(generator, *tensor.shape))


LAYER_PDL: Options = (("norm_pdl", True), ("rotary_pdl", True), ("write_pdl", True))
# every launch knob of the layer chain: the plain twin of a variant sets each one False
LAYER_KNOBS = ("norm_pdl", "rotary_pdl", "write_pdl", "attention_pdl", "router_pdl", "pdl")


# The PDL GEMV's (QKV, O) tiles beside pdl_tiles' (QKV 4 rows a program, O 2, a quarter of the
# depth before the wait): the fifteenth session's rule (run 1: 56.8 us a layer against 55.3), and
# the whole depth before the wait (no loop after it)
GEMV_TILES = {
    "fifteenth session's": (GemvTiles(16, 256, prefetch_k=512), GemvTiles(8, 512, prefetch_k=1024)),
    "whole depth, 4/2 rows": (GemvTiles(4, 16, 4, 1, 2048), GemvTiles(2, 16, 4, 1, 4096)),
}


def _gemv_options(name: str) -> Options:
    qkv, o = GEMV_TILES[name]
    return (("qkv_tiles", qkv), ("o_tiles", o))


OLD_GEMV, GEMV_WHOLE = _gemv_options("fifteenth session's"), _gemv_options("whole depth, 4/2 rows")


def _layer_variants() -> list[Variant]:
    """The defaults with cuBLAS projections and no PDL in the norms, rotary and KV write; the
    defaults (every PDL knob, the PDL GEMV); the fifteenth session's GEMV tiles, experts, both;
    the GEMV's whole depth before the wait; "tile-all"'s tiles around its default."""
    pdl: Options = (*LAYER_PDL, ("gemv_pdl", True))
    variants = [
        Variant("cuBLAS projections, no PDL norm/rotary/write"),
        Variant("+pdl all (the engine's defaults)", pdl),
        Variant("+pdl all, fifteenth session's gemv tiles", pdl + OLD_GEMV),
        Variant("+pdl all, fifteenth session's experts", pdl + FIFTEENTH),
        Variant("+pdl all, fifteenth session's gemv tiles and experts", pdl + OLD_GEMV + FIFTEENTH),
        Variant("+pdl all, gemv whole depth, 4/2 rows", pdl + GEMV_WHOLE),
    ]
    for n, warps in TILE_UP[:2]:
        tiles = (GemvConfig(n, HIDDEN, warps), TILE)
        variants.append(Variant(f"+pdl all, tile-all up({n},{warps})", (*pdl, ("configs", tiles))))
    tiles = (UP_TILE, GemvConfig(2, 1024, 4))
    variants.append(Variant("+pdl all, tile-all down(2,4)", (*pdl, ("configs", tiles))))
    return variants


class LayerChain(Chain):
    """Whole batch-1 decoder layers, chained as the model runs them (each layer's output and
    residual are the next one's input): rms_norm (+ residual), the QKV projection, the q/k norm
    and rotary, the KV write, the decode attention over 513 positions, the O projection,
    rms_norm (+ residual), the router, the experts. Every layer its own weights and KV."""

    name = "layer"

    def __init__(self, num_layers: int | None = None) -> None:
        self.num_layers = num_layers or LAYER_LAYERS
        generator = torch.Generator(DEVICE).manual_seed(2)
        layers = range(self.num_layers)
        q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
        self.qkv = [_randn(generator, q_size + 2 * kv_size, HIDDEN, scale=HIDDEN**-0.5)
                    for _ in layers]  # fmt: skip
        self.o = [_randn(generator, HIDDEN, q_size, scale=q_size**-0.5) for _ in layers]
        self.norms = [[1 + _randn(generator, size, scale=0.1) for size in
                       (HIDDEN, HIDDEN, HEAD_DIM, HEAD_DIM)] for _ in layers]  # fmt: skip
        self.w13 = [_randn(generator, NUM_EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5)
                    for _ in layers]  # fmt: skip
        self.w2 = [_randn(generator, NUM_EXPERTS, HIDDEN, INTER, scale=INTER**-0.5) for _ in layers]
        self.gate = [_randn(generator, NUM_EXPERTS, HIDDEN, scale=HIDDEN**-0.5) for _ in layers]
        self.tickets = [new_router_ticket(DEVICE) for _ in layers]
        self.merge_tickets = [new_merge_tickets(DEVICE) for _ in layers]
        shape = (2, MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.kv = [_randn(generator, *shape) for _ in layers]
        rotary = RotaryEmbedding(HEAD_DIM, MAX_MODEL_LEN, 1e6)
        self.cos_sin = rotary.cos_sin_cache.to(DEVICE)
        self.positions = torch.tensor([CONTEXT], dtype=torch.int64, device=DEVICE)
        self.unit_scale = torch.ones((), dtype=torch.float32, device=DEVICE)
        tables = torch.arange(MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.int32, device=DEVICE)
        self.meta = AttentionMetadata(
            slot_mapping=self.positions.clone(), block_tables=tables[None],
            seq_lens=torch.tensor([CONTEXT + 1], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            max_query_len=1, max_seq_len=MAX_MODEL_LEN,
        )  # fmt: skip
        self.x = _randn(generator, 1, HIDDEN)
        self.residual = _randn(generator, 1, HIDDEN)
        self.variants = _layer_variants()

    def reference(self, variant: Variant) -> Variant:
        """The same kernels with every launch plain (PDL off; the PDL GEMV launched plainly)."""
        options = dict(variant.options)
        options.update(dict.fromkeys(LAYER_KNOBS, False))
        if "gemv_pdl" in options:
            options["gemv_pdl"] = False
        return Variant(f"{variant.name}, plain", tuple(options.items()))

    def _project(self, variant: Variant, x: torch.Tensor, w: torch.Tensor, key: str):
        options = variant.kwargs("gemv_pdl", key)
        if "gemv_pdl" not in options:
            return F.linear(x, w)  # cuBLAS, as the model runs today
        return pdl_linear(x, w, None, options.get(key), pdl=options["gemv_pdl"])

    def run(self, variant: Variant) -> list[torch.Tensor]:
        option = variant.kwargs(*LAYER_KNOBS).get
        q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
        hidden, residual, outputs = self.x, self.residual, []
        for layer in range(self.num_layers):
            in_norm, post_norm, q_norm, k_norm = self.norms[layer]
            normed, residual = rms_norm(hidden, in_norm, 1e-6, residual, pdl=option("norm_pdl"))
            qkv = self._project(variant, normed, self.qkv[layer], "qkv_tiles")
            rotate_qk_(qkv, self.positions, self.cos_sin, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                       (q_norm, k_norm, 1e-6), pdl=option("rotary_pdl"))  # fmt: skip
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            kv_shape = (1, NUM_KV_HEADS, HEAD_DIM)
            write_kv_cache(self.kv[layer], k.reshape(kv_shape), v.reshape(kv_shape),
                           self.meta.slot_mapping, self.unit_scale, self.unit_scale,
                           pdl=option("write_pdl"))  # fmt: skip
            attended = paged_decode_attention(
                q.reshape(1, NUM_HEADS, HEAD_DIM), self.kv[layer], self.meta, HEAD_DIM**-0.5,
                self.unit_scale, self.unit_scale, tickets=self.merge_tickets[layer],
                pdl=option("attention_pdl"),
            )  # fmt: skip
            o = self._project(variant, attended.reshape(1, q_size), self.o[layer], "o_tiles")
            normed, residual = rms_norm(o, post_norm, 1e-6, residual, pdl=option("norm_pdl"))
            assert residual is not None
            weights, ids, _ = router_topk(
                normed, self.gate[layer], TOP_K, True, self.tickets[layer],
                pdl=option("router_pdl"),
            )  # fmt: skip
            hidden = fused_experts_direct(normed, self.w13[layer], self.w2[layer], weights, ids,
                                          pdl=option("pdl"),
                                          **variant.kwargs("kernels", "configs"))  # fmt: skip
            outputs += [ids, hidden]
        return [*outputs, residual]

    def refill(self, seed: int) -> None:
        generator = torch.Generator(DEVICE).manual_seed(seed)
        for tensor in (self.x, self.residual):
            tensor.copy_(_randn(generator, *tensor.shape))


GROUPS = {"moe": MoeChain, "attention": AttentionChain, "layer": LayerChain}
