"""Paged attention over a block-structured KV cache: the module and its torch reference.

KV cache layout (one tensor per layer, set by the engine):
``kv_cache[0 | 1, block_id, offset, kv_head, :]`` holds the key | value of the token at
position ``j * block_size + offset`` of every sequence whose ``block_tables[s, j] == block_id``.
``kv_cache.dtype`` is the model dtype, or an fp8 dtype: then stored values are
``(x / scale).to(fp8)`` and are read back as ``stored.float() * scale``.

The reference below is vectorized over tokens and sequences with shapes fixed by
``(num_tokens, num_seqs, max_query_len, block_tables.shape[1])``; it is what faster kernels are
checked against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dormant.layers.context import AttentionMetadata, get_attention_metadata
from dormant.layers.kernels import IS_TRITON_AVAILABLE, is_power_of_two, use_triton

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVCacheNotSetError(RuntimeError):
    """An attention layer ran before the engine attached its KV cache."""


def _quantize(x: Tensor, scale: Tensor, cache_dtype: torch.dtype) -> Tensor:
    if cache_dtype in FP8_DTYPES:
        return (x.float() / scale).to(cache_dtype)
    return x.to(cache_dtype)


def _dequantize(x: Tensor, scale: Tensor) -> Tensor:
    if x.dtype in FP8_DTYPES:
        return x.float() * scale
    return x.float()


def write_kv_cache(
    kv_cache: Tensor,
    key: Tensor,
    value: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor,
    v_scale: Tensor,
) -> None:
    """Stores ``key``/``value`` (``[num_tokens, num_kv_heads, head_dim]``) at ``slot_mapping``,
    in place. Precondition: the slots are distinct and in ``[0, num_blocks * block_size)``."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    slots = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots[0].index_put_((slot_mapping,), _quantize(key, k_scale, kv_cache.dtype))
    slots[1].index_put_((slot_mapping,), _quantize(value, v_scale, kv_cache.dtype))


def paged_attention_reference(
    query: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: Tensor,
    v_scale: Tensor,
) -> Tensor:
    """Causal attention of each new token over its sequence's cached keys and values.

    ``query`` is ``[num_tokens, num_heads, head_dim]``; query head h reads kv head
    ``h // (num_heads / num_kv_heads)``. Computes in float32; returns ``query``'s shape and
    dtype. Cache entries outside a sequence's first ``seq_lens[s]`` positions are never used,
    even if they hold NaN. Precondition: ``num_tokens == query_start_loc[-1]`` (every token
    belongs to a sequence).
    """
    if meta.max_query_len > 1:
        mixed = _split_decode_rows(query, kv_cache, meta, scale, k_scale, v_scale)
        if mixed is not None:
            return mixed
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs, max_num_blocks = meta.block_tables.shape
    max_kv_len = max_num_blocks * block_size
    device = query.device
    query_start = meta.query_start_loc.long()
    seq_lens = meta.seq_lens.long()
    context_lens = seq_lens - (query_start[1:] - query_start[:-1])  # cached prefix lengths

    # Each token's sequence and index within that sequence's new tokens.
    token_ids = torch.arange(num_tokens, device=device)
    token_seq = torch.searchsorted(query_start[1:], token_ids, right=True)
    token_index = token_ids - query_start[token_seq]
    padded_query = query.new_zeros(
        (num_seqs, meta.max_query_len, num_heads, head_dim), dtype=torch.float32
    )
    padded_query[token_seq, token_index] = query.float()

    # Gather each sequence's blocks; padding entries of the table are replaced by block 0.
    block_ids = torch.arange(max_num_blocks, device=device)
    num_used_blocks = (seq_lens + block_size - 1) // block_size
    is_used_block = block_ids[None, :] < num_used_blocks[:, None]
    tables = torch.where(is_used_block, meta.block_tables.long(), 0)
    kv_shape = (num_seqs, max_kv_len, num_kv_heads, head_dim)
    keys = _dequantize(kv_cache[0][tables], k_scale).reshape(kv_shape)
    values = _dequantize(kv_cache[1][tables], v_scale).reshape(kv_shape)
    key_pos = torch.arange(max_kv_len, device=device)
    is_valid_key = key_pos[None, :] < seq_lens[:, None]  # [num_seqs, max_kv_len]
    values = torch.where(is_valid_key[:, :, None, None], values, 0.0)  # 0 * NaN would leak

    query_pos = context_lens[:, None] + torch.arange(meta.max_query_len, device=device)[None, :]
    is_visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & is_valid_key[:, None, :]

    group = num_heads // num_kv_heads
    grouped = padded_query.view(num_seqs, meta.max_query_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("sqkgd,slkd->skgql", grouped, keys) * scale
    scores = scores.masked_fill(~is_visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgql,slkd->sqkgd", probs, values)
    out = out.reshape(num_seqs, meta.max_query_len, num_heads, head_dim)
    return out[token_seq, token_index].to(query.dtype)


def _split_decode_rows(
    query: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: Tensor,
    v_scale: Tensor,
) -> Tensor | None:
    """A mixed step (chunked prefill beside decodes) as two reference calls, its decode rows
    and its other rows, so the decode rows are not padded to the longest chunk (the padded
    scores would grow with rows x longest chunk). None when the rows are not mixed. Reads the
    query lengths on the host: the reference is not for graphs."""
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    is_decode = query_lens == 1
    num_decode = int(is_decode.sum())
    if num_decode in (0, meta.num_seqs):
        return None
    token_seq = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=query.device),
        query_lens.long(),
        output_size=query.shape[0],
    )
    out = torch.empty_like(query)
    for rows in (is_decode, ~is_decode):
        lens = query_lens[rows]
        starts = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=query.device)
        starts[1:] = torch.cumsum(lens, 0)
        tokens = rows[token_seq]
        part = AttentionMetadata(
            slot_mapping=meta.slot_mapping[tokens],
            block_tables=meta.block_tables[rows],
            seq_lens=meta.seq_lens[rows],
            query_start_loc=starts,
            max_query_len=int(lens.max()),
            max_seq_len=meta.max_seq_len,
        )
        out[tokens] = paged_attention_reference(
            query[tokens], kv_cache, part, scale, k_scale, v_scale
        )
    return out


# Merge tickets per layer (triton_attention.py): one per (sequence, kv head) of a split decode
# launch. plan_splits splits fewer pairs than PROGRAMS_PER_SM per SM (1056 on an H200's 132, 2048
# on 256 SMs); a launch of more pairs than this merges in a kernel of its own.
NUM_MERGE_TICKETS = 2048


def new_merge_tickets(device: torch.device | str | None = None) -> Tensor:
    """A layer's merge tickets: int32 ``[NUM_MERGE_TICKETS]``, zero (what every launch leaves
    them at)."""
    return torch.zeros(NUM_MERGE_TICKETS, dtype=torch.int32, device=device)


class PagedAttention(nn.Module):
    k_scale: Tensor  # buffers: calibrated state, kept in runtime memory
    v_scale: Tensor
    merge_tickets: Tensor  # a buffer: derived state, zero between launches

    """Writes this step's keys/values into the layer's KV cache, then attends over it.

    Buffers ``k_scale``/``v_scale`` (float32, shape ``[]``, persistent): fp8 cache scales,
    loadable from a checkpoint's ``...self_attn.k_scale``/``v_scale``. Buffer ``merge_tickets``
    (int32, not persistent): the Triton decode kernel's merge tickets (``triton_attention.py``),
    zero between launches, set by ``init_buffers``. ``kv_cache`` is a plain attribute (not a
    buffer), set by the engine:
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("merge_tickets", new_merge_tickets(), persistent=False)
        self.kv_cache: Tensor | None = None

    def init_buffers(self) -> None:
        """Zeroes the merge tickets in place (after materialization: adopted buffers start
        undefined)."""
        self.merge_tickets.zero_()

    def reset_kv_scales(self) -> None:
        """Sets both scales to 1.0 in place (after materialization, when no checkpoint has any)."""
        self.k_scale.fill_(1.0)
        self.v_scale.fill_(1.0)

    def checked_cache(self) -> Tensor:
        cache = self.kv_cache
        if cache is None:
            raise KVCacheNotSetError(
                f"attention layer {self.layer_idx} has no KV cache; the engine must set "
                "`kv_cache` on every layer (see CausalLM.attention_layers()) before a forward"
            )
        expected = (2, self.num_kv_heads, self.head_dim)
        if cache.dim() != 5 or (cache.shape[0], *cache.shape[3:]) != expected:
            raise ValueError(
                f"attention layer {self.layer_idx}: kv_cache shape {tuple(cache.shape)} is not "
                f"[2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}]"
            )
        return cache

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """``q`` ``[num_tokens, num_heads * head_dim]``, ``k``/``v``
        ``[num_tokens, num_kv_heads * head_dim]`` → ``[num_tokens, num_heads * head_dim]``.
        Runs inside ``forward_context``."""
        meta = get_attention_metadata()
        cache = self.checked_cache()
        num_tokens = q.shape[0]
        kv_shape = (num_tokens, self.num_kv_heads, self.head_dim)
        write = triton_write_kv_cache if _use_triton_write(cache) else write_kv_cache
        write(
            cache,
            k.reshape(kv_shape),
            v.reshape(kv_shape),
            meta.slot_mapping,
            self.k_scale,
            self.v_scale,
        )
        query = q.reshape(num_tokens, self.num_heads, self.head_dim)
        attend = _attention_kernel(cache, meta, self.merge_tickets)
        out = attend(query, cache, meta, self.scale, self.k_scale, self.v_scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale}, layer_idx={self.layer_idx}"
        )


def _use_triton_write(cache: Tensor) -> bool:
    return use_triton(cache) and is_power_of_two(cache.shape[-1]) and cache.is_contiguous()


def _attention_kernel(
    cache: Tensor, meta: AttentionMetadata, merge_tickets: Tensor
) -> Callable[..., Tensor]:
    """On a GPU: the Triton decode kernel for decode steps (its splits merged on the layer's
    ``merge_tickets``), the Triton prefill kernel for everything else. The CPU, and heads that
    are not a power of two of at least 16, use the reference."""
    head_dim = cache.shape[-1]
    if not use_triton(cache) or head_dim < 16 or not is_power_of_two(head_dim):
        return paged_attention_reference
    if meta.max_query_len == 1:
        return functools.partial(paged_decode_attention, tickets=merge_tickets)
    return paged_prefill_attention


if IS_TRITON_AVAILABLE:  # else (CPU-only installs) the reference serves every step
    from dormant.layers.triton_attention import paged_decode_attention
    from dormant.layers.triton_kv_cache import write_kv_cache as triton_write_kv_cache
    from dormant.layers.triton_prefill import paged_prefill_attention
