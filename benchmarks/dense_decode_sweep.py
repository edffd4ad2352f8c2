"""The dense decode layer at rollout batch sizes (issue 16), each choice of launch and attention
split: which defaults bring a batch-64+ step closer to 1.4x its roofline. One call on the H200,
about 2 minutes.

Qwen3-8B's shapes (hidden 4096, 32 q / 8 kv heads, head_dim 128, intermediate 12288) in bf16 on
random weights, each layer its own (L2 serves no later layer). A layer is what the engine
launches on the Triton path (``DecoderLayer.forward``): the input norm with its residual, the
QKV projection (cuBLAS), the q/k norms and rotary (one kernel), the KV write, the decode
attention (its splits merged by the layer's merge tickets), the O projection, the
post-attention norm, the gate/up projection, ``silu_and_mul`` and the down projection. Every
sequence is at position ``--context`` in tables planned for ``MAX_MODEL_LEN`` (the rollout's
512 + 512): what a captured graph plans its splits for.

Variants per batch size: the defaults; the merge in a kernel of its own; programmatic dependent
launch (``triton_pdl.py``) in every Triton kernel of the layer (``pdl``, what
``USE_PDL_ABOVE_BATCH_1`` turns on); and each split count, with and without it. Each is
captured in one CUDA graph over ``NUM_LAYERS`` layers (``moe_b1_sweep.run_variant``: timed
replays, the median per layer), then replayed on fresh inputs and checked against its own
kernels launched plainly and eagerly: a variant that changes only the launch must give the same
bits (``bit_exact``). Each row also gives the layer's roofline (its weights and the KV it reads,
at the measured copy bandwidth) and the median against it (``x_roofline``; the engine's step
adds the LM head, the sampler and host work, ``benchmarks/rollout.py``).

Usage: python benchmarks/dense_decode_sweep.py [--out results.jsonl] [--batch-sizes 64,128,256]
[--context 768] [--budget-s 150]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Recorder, environment, table
from benchmarks.moe_b1_chains import Chain, Variant
from dormant.layers.attention import new_merge_tickets
from dormant.layers.context import AttentionMetadata
from dormant.layers.rotary import RotaryEmbedding
from dormant.layers.triton_activation import silu_and_mul
from dormant.layers.triton_attention import paged_decode_attention
from dormant.layers.triton_kv_cache import write_kv_cache
from dormant.layers.triton_norm import rms_norm
from dormant.layers.triton_rotary import rotate_qk_

HIDDEN, INTER, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4096, 12288, 32, 8, 128
BLOCK_SIZE, MAX_MODEL_LEN, NUM_LAYERS = 16, 1024, 6
EPS = 1e-6
DTYPE = torch.bfloat16
SPLITS = (1, 2, 4, 8)
PDL_KEYS = ("pdl",)


def variants() -> list[Variant]:
    """The defaults first, then the merge in a kernel of its own (as before the merge tickets),
    then each split count; then all of them with PDL."""
    plain = [Variant("default"), Variant("merge kernel", (("merge_kernel", True),))]
    plain += [Variant(f"splits {n}", (("wanted_splits", n),)) for n in SPLITS]
    with_pdl = [Variant(f"{v.name} +pdl", (*v.options, ("pdl", True))) for v in plain]
    return plain + with_pdl


class DenseLayerChain(Chain):
    """``NUM_LAYERS`` dense decoder layers at ``batch`` sequences of ``context`` positions."""

    def __init__(self, batch: int, context: int, num_layers: int = NUM_LAYERS,
                 device: torch.device | None = None) -> None:  # fmt: skip
        self.name, self.num_layers = f"b{batch}", num_layers
        self.batch, self.context = batch, context
        self.device = device or torch.device("cuda")
        generator = torch.Generator(self.device).manual_seed(0)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, device=self.device, dtype=DTYPE) * scale

        self._randn = randn
        layers = range(num_layers)
        qkv_out = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        self.w_qkv = [randn(qkv_out, HIDDEN, scale=HIDDEN**-0.5) for _ in layers]
        self.w_o = [randn(HIDDEN, NUM_HEADS * HEAD_DIM, scale=HIDDEN**-0.5) for _ in layers]
        self.w_up = [randn(2 * INTER, HIDDEN, scale=HIDDEN**-0.5) for _ in layers]
        self.w_down = [randn(HIDDEN, INTER, scale=INTER**-0.5) for _ in layers]
        self.norms = [[1 + randn(HIDDEN, scale=0.1) for _ in range(2)] for _ in layers]
        self.qk_norms = [[1 + randn(HEAD_DIM, scale=0.1) for _ in range(2)] for _ in layers]
        blocks_per_seq = MAX_MODEL_LEN // BLOCK_SIZE
        cache_shape = (2, batch * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.kv = [randn(*cache_shape) for _ in layers]
        self.merge_tickets = [new_merge_tickets(self.device) for _ in layers]
        self.rotary = RotaryEmbedding(HEAD_DIM, MAX_MODEL_LEN, 1e6).to(self.device)
        self.unit_scale = torch.ones((), dtype=torch.float32, device=self.device)
        seqs = torch.arange(batch, dtype=torch.int64, device=self.device)
        tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=self.device)
        self.positions = torch.full((batch,), context, dtype=torch.int64, device=self.device)
        self.meta = AttentionMetadata(
            slot_mapping=seqs * MAX_MODEL_LEN + context,  # each sequence's blocks are its own
            block_tables=tables.view(batch, blocks_per_seq),
            seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=self.device),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=self.device),
            max_query_len=1,
            max_seq_len=MAX_MODEL_LEN,
        )
        self.hidden = randn(batch, HIDDEN)
        self.residual = randn(batch, HIDDEN)
        self.variants = variants()

    def run(self, variant: Variant) -> list[torch.Tensor]:
        hidden, residual = self.hidden, self.residual
        outputs = []
        for layer in range(self.num_layers):
            attention, residual = self.attend(layer, hidden, residual, variant)
            hidden, residual = self.feed_forward(layer, attention, residual, variant)
            outputs += [attention, hidden]
        return outputs

    def attend(
        self, layer: int, hidden: torch.Tensor, residual: torch.Tensor, variant: Variant
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer up to its attention's output: the input norm with its residual, QKV, the
        q/k norms and rotary, the KV write and the decode attention; (attention, residual)."""
        pdl = variant.kwargs("pdl")
        q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
        normed, residual = rms_norm(hidden, self.norms[layer][0], EPS, residual, **pdl)
        qkv = F.linear(normed, self.w_qkv[layer])
        q_norm, k_norm = self.qk_norms[layer]
        rotate_qk_(qkv, self.positions, self.rotary.cos_sin_cache, NUM_HEADS, NUM_KV_HEADS,
                   HEAD_DIM, (q_norm, k_norm, EPS), **pdl)  # fmt: skip
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        kv_shape = (self.batch, NUM_KV_HEADS, HEAD_DIM)
        scales = (self.unit_scale, self.unit_scale)
        write_kv_cache(self.kv[layer], k.reshape(kv_shape), v.reshape(kv_shape),
                       self.meta.slot_mapping, *scales, **pdl)  # fmt: skip
        is_merge_kernel = variant.kwargs("merge_kernel").get("merge_kernel", False)
        attention = paged_decode_attention(
            q.reshape(self.batch, NUM_HEADS, HEAD_DIM), self.kv[layer], self.meta,
            HEAD_DIM**-0.5, *scales,
            tickets=None if is_merge_kernel else self.merge_tickets[layer],
            **variant.kwargs("wanted_splits", "pdl"),
        )  # fmt: skip
        return attention, residual

    def feed_forward(
        self, layer: int, attention: torch.Tensor, residual: torch.Tensor, variant: Variant
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the layer: the O projection, the post-attention norm, gate/up, SiLU and
        down; (hidden, residual)."""
        pdl = variant.kwargs("pdl")
        o = F.linear(attention.reshape(self.batch, NUM_HEADS * HEAD_DIM), self.w_o[layer])
        normed, residual = rms_norm(o, self.norms[layer][1], EPS, residual, **pdl)
        hidden = F.linear(silu_and_mul(F.linear(normed, self.w_up[layer]), **pdl),
                          self.w_down[layer])  # fmt: skip
        return hidden, residual

    def refill(self, seed: int) -> None:
        generator = torch.Generator(self.device).manual_seed(seed)
        for tensor in (self.hidden, self.residual):
            tensor.copy_(torch.randn(*tensor.shape, generator=generator, device=self.device,
                                     dtype=DTYPE))  # fmt: skip

    def reference(self, variant: Variant) -> Variant:
        """The same kernels launched plainly: PDL changes no bit."""
        return Variant(f"{variant.name} plain", (*variant.options, ("pdl", False)))

    def roofline_s(self, bandwidth: float) -> float:
        """Seconds a layer takes to read its weights and the KV it attends over at
        ``bandwidth``, the copy's bytes read plus written per second (as
        ``benchmarks/rollout.py``'s roofline)."""
        weights = sum(w[0].numel() for w in (self.w_qkv, self.w_o, self.w_up, self.w_down))
        kv = 2 * self.batch * (self.context + 1) * NUM_KV_HEADS * HEAD_DIM
        return (weights + kv) * DTYPE.itemsize / bandwidth


def main() -> None:
    from benchmarks.decode import device_copy_bandwidth
    from benchmarks.moe_b1_sweep import run_variant

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON lines are appended here too")
    parser.add_argument("--batch-sizes", default="64,128,256")
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="no new variant starts after this many seconds")  # fmt: skip
    args = parser.parse_args()
    rec = Recorder(args.out)
    bandwidth = device_copy_bandwidth()
    rec.emit(case="environment", copy_bandwidth=bandwidth, **environment())
    rows: list[dict] = []
    start = time.perf_counter()
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        chain = DenseLayerChain(batch, args.context)
        roofline = chain.roofline_s(bandwidth)
        baseline = None
        for variant in chain.variants:
            if time.perf_counter() - start > args.budget_s:
                rows.append(rec.emit(group=chain.name, variant=variant.name,
                                     error="skipped: --budget-s"))  # fmt: skip
                continue
            row = run_variant(rec, chain, variant, baseline)
            if "per_layer_us" in row:
                baseline = baseline if baseline is not None else row["per_layer_us"] / 1e6
                row["x_roofline"] = row["per_layer_us"] / 1e6 / roofline
                rec.emit(case="against roofline", group=chain.name, variant=variant.name,
                         roofline_us=roofline * 1e6, x_roofline=row["x_roofline"])  # fmt: skip
            rows.append(row)
        del chain
        torch.cuda.empty_cache()
    columns = ["group", "variant", "per_layer_us", "delta_us", "x_roofline", "bit_exact", "is_ok"]
    print(table(rows, columns))


if __name__ == "__main__":
    main()
