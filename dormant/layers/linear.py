"""Tensor-parallel linear layers (Megatron style).

| layer                      | weight (local)             | input    | output                 |
|----------------------------|----------------------------|----------|------------------------|
| ReplicatedLinear           | [out, in]                  | full     | full                   |
| ColumnParallelLinear       | [out / tp, in]             | full     | this rank's out slice  |
| MergedColumnParallelLinear | [sum(out_i / tp), in]      | full     | each part's slice      |
| QKVParallelLinear          | [local (q + 2 kv) dims, in]| full     | local q, k, v heads    |
| RowParallelLinear          | [out, in / tp]             | in slice | full, all-reduced      |

Each layer's weight loader sits beside its sharding: it takes the full checkpoint tensor and
copies this rank's part in place.

A layer opted in with ``enable_skinny_gemv`` runs its local matmul with the Triton skinny GEMV
(``triton_gemv.py``) for decode sizes on the GPU (``is_skinny``): same rounding points, another
summation order than cuBLAS; the Qwen3-MoE model opts its attention projections in, no other
model does. A layer opted in with ``enable_pdl_gemv`` runs one token with ``pdl_linear`` (its
weights prefetched under programmatic dependent launch) while ``triton_gemv.USE_PDL_AT_BATCH_1``
is set (read at each call: on by default); Qwen3-MoE opts its attention projections in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dormant.distributed import get_tp_group
from dormant.layers.kernels import IS_TRITON_AVAILABLE, use_triton
from dormant.layers.weight_utils import (
    ShardId,
    check_loaded_shape,
    check_no_shard_id,
    divide,
    load_narrowed,
    set_weight_attrs,
)

if IS_TRITON_AVAILABLE:
    from dormant.layers.triton_gemv import can_pdl_gemv, is_skinny, pdl_linear, skinny_linear


class LinearBase(nn.Module):
    """A linear layer whose weight is split along ``tp_dim`` (0: output, 1: input) or not at all
    (``tp_dim=None``). The bias, if any, follows the output dimension."""

    def __init__(
        self,
        local_input_size: int,
        local_output_size: int,
        *,
        bias: bool,
        tp_dim: int | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.world_size
        self.tp_dim = tp_dim
        self.weight = nn.Parameter(
            torch.empty(local_output_size, local_input_size, dtype=dtype), requires_grad=False
        )
        set_weight_attrs(self.weight, self.weight_loader, self.loaded_shape)
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(local_output_size, dtype=dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, self.weight_loader, self.loaded_shape)
        else:
            self.register_parameter("bias", None)

    is_skinny_gemv = False  # opted in by enable_skinny_gemv
    is_pdl_gemv = False  # opted in by enable_pdl_gemv

    def enable_skinny_gemv(self) -> None:
        """From now on, batches of up to ``SKINNY_MAX_TOKENS`` rows on the GPU run the Triton
        skinny GEMV (faster than cuBLAS's at decode sizes; not bit-identical to it)."""
        self.is_skinny_gemv = True

    def enable_pdl_gemv(self) -> None:
        """From now on, one token on a GPU with PDL runs ``pdl_linear`` while
        ``triton_gemv.USE_PDL_AT_BATCH_1`` is set (not bit-identical to cuBLAS)."""
        self.is_pdl_gemv = True

    def _linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """This rank's ``x @ weight.T (+ bias)``."""
        if (
            self.is_pdl_gemv  # first: the models that did not opt in pay one attribute read
            and use_triton(x)
            and x.dim() == 2
            and x.stride(1) == 1
            and can_pdl_gemv(x)
        ):
            return pdl_linear(x, self.weight, bias)
        if (
            self.is_skinny_gemv  # first: the models that did not opt in pay one attribute read
            and use_triton(x)
            and x.dim() == 2
            and is_skinny(x.shape[0])
            and x.stride(1) == 1
        ):
            return skinny_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def _param_tp_dim(self, param: Tensor) -> int | None:
        # A row-parallel bias is replicated: it lives on the full output dimension.
        if self.tp_dim is None or self.tp_dim >= param.dim():
            return None
        return self.tp_dim

    def loaded_shape(self, param: Tensor, shard_id: ShardId | None = None) -> torch.Size:
        check_no_shard_id(shard_id)
        dim = self._param_tp_dim(param)
        shape = list(param.shape)
        if dim is not None:
            shape[dim] *= self.tp_size
        return torch.Size(shape)

    def weight_loader(
        self, param: Tensor, loaded_weight: Tensor, shard_id: ShardId | None = None
    ) -> None:
        check_loaded_shape(param, loaded_weight, self.loaded_shape(param, shard_id), shard_id)
        dim = self._param_tp_dim(param)
        if dim is None:
            param.data.copy_(loaded_weight)
        else:
            load_narrowed(param.data, loaded_weight, dim, self.tp_rank, self.tp_size)

    def forward(self, x: Tensor) -> Tensor:
        return self._linear(x, self.bias)


class ReplicatedLinear(LinearBase):
    """A linear layer held whole by every rank."""

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(input_size, output_size, bias=bias, tp_dim=None, dtype=dtype)


class ColumnParallelLinear(LinearBase):
    """Splits the output dimension: rank r computes outputs ``[r * out/tp, (r + 1) * out/tp)``."""

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype | None = None
    ) -> None:
        tp_size = get_tp_group().world_size
        local_output_size = divide(output_size, tp_size, "output size")
        super().__init__(input_size, local_output_size, bias=bias, tp_dim=0, dtype=dtype)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel layers fused along the output (e.g. gate and up projections).

    Shard id ``i`` loads part ``i`` (a full ``[output_sizes[i], in]`` checkpoint tensor).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp_size = get_tp_group().world_size
        self.local_output_sizes = [divide(n, tp_size, "output size") for n in output_sizes]
        super().__init__(input_size, sum(self.local_output_sizes), bias=bias, tp_dim=0, dtype=dtype)

    def _part(self, shard_id: ShardId | None) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_output_sizes):
            raise ValueError(
                f"shard id must be an int in [0, {len(self.local_output_sizes)}), got {shard_id!r}"
            )
        return shard_id

    def loaded_shape(self, param: Tensor, shard_id: ShardId | None = None) -> torch.Size:
        part = self._part(shard_id)
        return torch.Size((self.local_output_sizes[part] * self.tp_size, *param.shape[1:]))

    def weight_loader(
        self, param: Tensor, loaded_weight: Tensor, shard_id: ShardId | None = None
    ) -> None:
        check_loaded_shape(param, loaded_weight, self.loaded_shape(param, shard_id), shard_id)
        part = self._part(shard_id)
        offset = sum(self.local_output_sizes[:part])
        destination = param.data.narrow(0, offset, self.local_output_sizes[part])
        load_narrowed(destination, loaded_weight, 0, self.tp_rank, self.tp_size)


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection, split by attention heads.

    Query heads are split evenly. Key/value heads are split evenly when ``tp <= total kv
    heads``; otherwise each kv head is replicated on ``tp / total_num_kv_heads`` consecutive
    ranks, so rank r holds kv head ``r // (tp / total_num_kv_heads)``, the one its query heads
    use. Shard ids are ``"q"``, ``"k"``, ``"v"``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        *,
        bias: bool,
        dtype: torch.dtype | None = None,
    ) -> None:
        tp_size = get_tp_group().world_size
        tp_rank = get_tp_group().rank
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.local_num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            num_replicas = divide(tp_size, total_num_kv_heads, "TP size (more ranks than kv heads)")
            self.local_num_kv_heads = 1
            self.kv_head_start = tp_rank // num_replicas
        else:
            self.local_num_kv_heads = divide(total_num_kv_heads, tp_size, "number of kv heads")
            self.kv_head_start = tp_rank * self.local_num_kv_heads
        self.q_size = self.local_num_heads * head_dim
        self.kv_size = self.local_num_kv_heads * head_dim
        super().__init__(
            hidden_size, self.q_size + 2 * self.kv_size, bias=bias, tp_dim=0, dtype=dtype
        )

    def _layout(self, shard_id: ShardId | None) -> tuple[int, int, int, int]:
        """(offset in param, local size, start in checkpoint tensor, total checkpoint size)."""
        if shard_id == "q":
            total = self.total_num_heads * self.head_dim
            return 0, self.q_size, self.tp_rank * self.q_size, total
        if shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            total = self.total_num_kv_heads * self.head_dim
            return offset, self.kv_size, self.kv_head_start * self.head_dim, total
        raise ValueError(f"shard id must be 'q', 'k' or 'v', got {shard_id!r}")

    def loaded_shape(self, param: Tensor, shard_id: ShardId | None = None) -> torch.Size:
        return torch.Size((self._layout(shard_id)[3], *param.shape[1:]))

    def weight_loader(
        self, param: Tensor, loaded_weight: Tensor, shard_id: ShardId | None = None
    ) -> None:
        check_loaded_shape(param, loaded_weight, self.loaded_shape(param, shard_id), shard_id)
        offset, size, start, _ = self._layout(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Splits the input dimension; partial products are all-reduced.

    The input is this rank's slice of the features (the output of a column-parallel layer).
    The bias is replicated and added once, after the all-reduce.
    """

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool, dtype: torch.dtype | None = None
    ) -> None:
        tp_size = get_tp_group().world_size
        local_input_size = divide(input_size, tp_size, "input size")
        super().__init__(local_input_size, output_size, bias=bias, tp_dim=1, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.tp_size == 1:
            return self._linear(x, self.bias)
        y = self.tp_group.all_reduce(self._linear(x, None))
        return y if self.bias is None else y + self.bias
