"""Maps Hugging Face checkpoint names onto a model's parameters, and validates and loads them.

Every accepted checkpoint name has a ``WeightTarget``: the tensor it lands in, the shard id
(for packed parameters such as ``qkv_proj``), the owning layer's loader, and the full
(unsharded) shape the checkpoint must have. ``weight_targets`` builds the table from the live
modules; ``CausalLM`` keeps it once the model is materialised (building it costs milliseconds,
which a refit of one tensor at a time would pay per tensor).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor, nn

from dormant.layers.attention import PagedAttention
from dormant.layers.norm import RMSNorm
from dormant.layers.weight_utils import (
    LoadedShape,
    ShardId,
    WeightLoader,
    default_loaded_shape,
    default_weight_loader,
)
from dormant.models.errors import WeightError

PackedMapping = Mapping[str, tuple[str, ShardId]]  # checkpoint module -> (our module, shard id)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EXPERT_NAME = re.compile(r"(.+\.experts)\.(\d+)\.(.+)")  # <layer>.mlp.experts.<e>.<leaf>
_NOTHING_WRITTEN = (
    "Nothing was written. Check that the checkpoint matches config.json (architecture, sizes, "
    "tie_word_embeddings) and holds full, unsharded Hugging Face tensors in a float dtype."
)


class WeightKind(Enum):
    MATRIX = "matrix"  # linear weights and embeddings
    NORM = "norm"
    BIAS = "bias"
    SCALE = "scale"  # fp8 k/v cache scales (buffers; optional in a checkpoint)


@dataclass(frozen=True)
class WeightTarget:
    tensor: Tensor
    shard_id: ShardId | None
    loader: WeightLoader
    full_shape: torch.Size
    kind: WeightKind
    # An alias: another layout of these names' tensors (transformers 5's in-memory fused
    # experts). Writing it writes them; a complete checkpoint need not hold it.
    covers: tuple[str, ...] = ()

    def shape_problem(self, shape: torch.Size) -> str | None:
        if self.kind is WeightKind.SCALE:
            return None if math.prod(shape) == 1 else "expected a single element"
        if shape != self.full_shape:
            return f"expected {tuple(self.full_shape)} (the full, unsharded shape)"
        return None


def _load_scale(param: Tensor, loaded_weight: Tensor, shard_id: ShardId | None = None) -> None:
    param.copy_(loaded_weight.reshape(param.shape))


def weight_targets(model: nn.Module, packed: PackedMapping) -> dict[str, WeightTarget]:
    """All checkpoint names ``model`` accepts, in module order. A tied parameter appears once,
    under its first name."""
    unpacked: dict[str, list[tuple[str, ShardId | None]]] = {}
    for checkpoint_name, (our_name, shard_id) in packed.items():
        unpacked.setdefault(our_name, []).append((checkpoint_name, shard_id))
    table: dict[str, WeightTarget] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        prefix, _, leaf = module_name.rpartition(".")
        loader: WeightLoader = getattr(module, "weight_loader", default_weight_loader)
        loaded_shape: LoadedShape = getattr(module, "loaded_shape", default_loaded_shape)
        named_shards = getattr(module, "checkpoint_weights", None)
        if named_shards is not None:  # a fused layer names its checkpoint tensors itself
            for leaf_name, param, shard_id in named_shards():
                seen.add(id(param))
                shape = loaded_shape(param, shard_id)
                target = WeightTarget(param, shard_id, loader, shape, WeightKind.MATRIX)
                table[f"{module_name}.{leaf_name}"] = target
            aliases = getattr(module, "checkpoint_aliases", tuple)
            for leaf_name, param, shard_id, covered in aliases():
                shape = loaded_shape(param, shard_id)
                names = tuple(f"{module_name}.{leaf}" for leaf in covered)
                target = WeightTarget(param, shard_id, loader, shape, WeightKind.MATRIX, names)
                table[f"{module_name}.{leaf_name}"] = target
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            kind = (
                WeightKind.NORM
                if isinstance(module, RMSNorm)
                else WeightKind.BIAS
                if param_name == "bias"
                else WeightKind.MATRIX
            )
            for checkpoint_leaf, shard_id in unpacked.get(leaf, [(leaf, None)]):
                name = ".".join(p for p in (prefix, checkpoint_leaf, param_name) if p)
                shape = loaded_shape(param, shard_id)
                table[name] = WeightTarget(param, shard_id, loader, shape, kind)
        if isinstance(module, PagedAttention):
            # Checkpoints name the scales on the attention block: `...self_attn.k_scale`.
            for buffer_name in ("k_scale", "v_scale"):
                buffer = getattr(module, buffer_name)
                name = f"{prefix}.{buffer_name}"
                table[name] = WeightTarget(
                    buffer, None, _load_scale, torch.Size(()), WeightKind.SCALE
                )
    return table


def is_ignored(name: str, is_tied: bool) -> bool:
    """Names accepted and skipped: rotary caches, and ``lm_head.weight`` of a tied model."""
    return name.endswith(_IGNORED_SUFFIXES) or (is_tied and name == "lm_head.weight")


def item_problem(
    name: str,
    shape: torch.Size,
    dtype: torch.dtype,
    table: Mapping[str, WeightTarget],
    exact_dtype: bool = False,
) -> str | None:
    """One line describing what is wrong with a checkpoint entry, or None if it fits.

    With ``exact_dtype`` the dtype must be the target's own (a refit never casts silently).
    """
    target = table.get(name)
    if target is None:
        expert_problem = _missing_expert(name, table)
        if expert_problem is not None:
            return f"{name}: {expert_problem}"
        close = difflib.get_close_matches(name, table.keys(), n=1)
        suggestion = f"; did you mean {close[0]!r}?" if close else ""
        return f"{name}: no such weight in this model{suggestion}"
    shape_problem = target.shape_problem(torch.Size(shape))
    if shape_problem is not None:
        return f"{name}: shape {tuple(shape)}, {shape_problem}"
    if dtype not in _FLOAT_DTYPES:
        return (
            f"{name}: dtype {dtype}, expected float32/float16/bfloat16 "
            "(quantized checkpoint weights are not supported)"
        )
    if exact_dtype and dtype != target.tensor.dtype:
        return f"{name}: dtype {dtype}, expected {target.tensor.dtype} (cast it before the refit)"
    return None


def _missing_expert(name: str, table: Mapping[str, WeightTarget]) -> str | None:
    """Why an expert's name is unknown, when its layer exists: the expert index is past the
    layer's experts, or the layer is dense."""
    match = _EXPERT_NAME.fullmatch(name)
    if match is None:
        return None
    prefix, _, leaf = match.groups()
    count = 0
    while f"{prefix}.{count}.{leaf}" in table:
        count += 1
    if count:
        return f"no such expert: this layer has experts 0..{count - 1}"
    dense = prefix.removesuffix(".experts") + "." + leaf
    if dense in table:
        return f"this layer is dense (mlp_only_layers / decoder_sparse_step): its MLP is {dense}"
    return None


def check_weights(
    table: Mapping[str, WeightTarget],
    is_tied: bool,
    items: Sequence[tuple[str, torch.Size, torch.dtype]],
    require_complete: bool,
    exact_dtype: bool = False,
) -> None:
    """Raises ``WeightError`` listing every bad entry; writes nothing."""
    problems: list[str] = []
    seen: set[str] = set()
    covered: set[str] = set()  # written through an alias
    for name, shape, dtype in items:
        if name in seen:
            problems.append(f"{name}: appears more than once")
        seen.add(name)
        if name in table:
            covered.update(table[name].covers)
        if is_ignored(name, is_tied):
            continue
        problem = item_problem(name, shape, dtype, table, exact_dtype)
        if problem is not None:
            problems.append(problem)
    if require_complete:
        required = [n for n, t in table.items() if t.kind is not WeightKind.SCALE and not t.covers]
        problems.extend(
            f"{n}: missing from the checkpoint" for n in required if n not in seen | covered
        )
    if problems:
        raise WeightError(problems, _NOTHING_WRITTEN)


@torch.no_grad()
def load_weights(
    table: Mapping[str, WeightTarget], is_tied: bool, weights: Iterable[tuple[str, Tensor]]
) -> set[str]:
    """Writes each tensor in place through its loader; returns the names written (for an
    alias, the names it covers).

    Each entry is checked before it is written; a bad entry raises ``WeightError``, and the
    entries before it stay written (use ``check_weights`` first to reject a whole checkpoint).
    """
    written: set[str] = set()
    for name, tensor in weights:
        if is_ignored(name, is_tied):
            continue
        problem = item_problem(name, tensor.shape, tensor.dtype, table)
        if problem is not None:
            raise WeightError(
                [problem],
                f"{len(written)} earlier tensors were already written; validate the checkpoint "
                "with check_weights before loading to reject it without writing anything.",
            )
        target = table[name]
        target.loader(target.tensor, tensor, target.shard_id)
        written.update(target.covers or (name,))
    return written


def expected_weight_shapes(table: Mapping[str, WeightTarget]) -> dict[str, torch.Size]:
    """Name → full shape of every tensor a complete checkpoint provides (k/v scales, being
    optional, and aliases are not listed)."""
    return {
        n: t.full_shape for n, t in table.items() if t.kind is not WeightKind.SCALE and not t.covers
    }


@torch.no_grad()
def init_random_weights(table: Mapping[str, WeightTarget], seed: int) -> None:
    """Fills every parameter in place: N(0, 0.02) matrices, ones for norms, zeros for biases.

    Full checkpoint-shaped tensors are drawn in a fixed order from one generator on the
    parameters' device, then sharded by the loaders: every TP rank draws the same numbers,
    so a sharded model equals the unsharded one. k/v scales are left alone.
    """
    device = next(iter(table.values())).tensor.device
    if device.type == "meta":
        raise RuntimeError("the model is on the meta device; materialize it before initializing")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for target in table.values():
        dtype, shape = target.tensor.dtype, target.full_shape
        if target.kind is WeightKind.SCALE or target.covers:
            continue
        if target.kind is WeightKind.NORM:
            full = torch.ones(shape, dtype=dtype, device=device)
        elif target.kind is WeightKind.BIAS:
            full = torch.zeros(shape, dtype=dtype, device=device)
        else:
            full = torch.empty(shape, dtype=dtype, device=device)
            full.normal_(0.0, 0.02, generator=generator)
        target.loader(target.tensor, full, target.shard_id)
