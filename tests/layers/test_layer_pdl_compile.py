"""The rest of the decode layer under programmatic dependent launch, compiled for the H200
(sm_90) on the CPU at Qwen3-30B-A3B's shapes: the RMSNorm, the rotary kernel (with the q/k
norm), the KV write, the attention's merge, ``silu_and_mul`` (the dense MLP's, PDL above batch
1 only when ``USE_PDL_ABOVE_BATCH_1`` is set) and the PDL GEMV (``pdl_linear``) of the QKV and O
projections, at its default tiles and the ones ``benchmarks/moe_b1_sweep.py`` times.

- none spills a register;
- under PDL each waits once (``griddepcontrol.wait``) and triggers the next kernel only after
  that wait (``triton_pdl.py``'s rules); without it, no ``griddepcontrol`` at all;
- what each may read before the wait (weights, the position and its cos/sin row, the slot) is
  loaded before it in the SASS ptxas emits, and what the previous kernel wrote is read after
  it from L2 (``ld.global.cg``);
- the GEMV issues its whole prefetch tile before the wait: ``block_n * prefetch_k`` weights in
  16-byte loads.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
from benchmarks.moe_b1_chains import GEMV_TILES  # noqa: E402
from dormant.layers import (  # noqa: E402
    triton_activation,
    triton_attention,
    triton_gemv,
    triton_kv_cache,
    triton_norm,
    triton_rotary,
)
from tests.layers.test_moe_b1_compile import _sass  # noqa: E402
from tests.layers.test_triton_moe_compile import _compile, _spill_bytes  # noqa: E402

NORM_ARGS = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "residual_out_ptr": "*bf16",
             "out_ptr": "*bf16", "weight_ptr": "*bf16", "n": "i32", "eps": "fp32",
             "stride_x": "i32", "stride_residual": "i32", "stride_residual_out": "i32",
             "stride_out": "i32"}  # fmt: skip
ROTARY_ARGS = {"qkv_ptr": "*bf16", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32",
               "q_weight_ptr": "*bf16", "k_weight_ptr": "*bf16", "eps": "fp32",
               "stride_token": "i32", "stride_cos_sin": "i32"}  # fmt: skip
WRITE_ARGS = {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*bf16",
              "slot_mapping_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
              "stride_key_token": "i32", "stride_key_head": "i32", "stride_value_token": "i32",
              "stride_value_head": "i32", "stride_cache_kv": "i32",
              "stride_cache_slot": "i32"}  # fmt: skip
SILU_ARGS = {"x_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32", "stride_x": "i32",
             "stride_out": "i32"}  # fmt: skip
MERGE_ARGS = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
              "stride_o_seq": "i32", "stride_o_head": "i32"}  # fmt: skip
GEMV_ARGS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32",
             "K": "i32", "stride_w": "i32"}  # fmt: skip
QKV_SHAPE, O_SHAPE = (5120, 2048), (2048, 4096)


def _cache(pdl: bool) -> str:
    return ".cg" if pdl else ""


def _check_pdl(kernel, pdl: bool, *, is_l2_after: bool = True) -> str:
    """The PTX's wait and trigger (or neither, without PDL); with ``is_l2_after`` every global
    load after the wait is ``.cg``. Returns the SASS before the wait ("" without PDL)."""
    ptx = kernel.asm["ptx"]
    assert _spill_bytes(kernel) == 0
    if not pdl:
        assert "griddepcontrol" not in ptx
        return ""
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("griddepcontrol.launch_dependents")
    if is_l2_after:
        after = re.findall(r"ld\.global[.\w]*", ptx[wait:])
        assert after and all(".cg" in load for load in after), after
    sass = _sass(kernel)
    return sass[: sass.index("ACQBULK")]  # griddepcontrol.wait in sm_90 SASS


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_rms_norm_loads_its_weight_before_the_wait(pdl: bool, has_residual: bool) -> None:
    constexprs = {"HAS_RESIDUAL": has_residual, "BLOCK": 2048, "USE_PDL": pdl,
                  "CACHE": _cache(pdl)}  # fmt: skip
    kernel = _compile(triton_norm._rms_norm_kernel, NORM_ARGS, constexprs, num_warps=4)
    before = _check_pdl(kernel, pdl)
    if pdl:
        assert before.count("LDG.E") >= 1, "the weight is not loaded before the wait"
        assert "STG" not in before


@pytest.mark.parametrize("pdl", [False, True])
def test_the_rotary_kernel_loads_position_cos_sin_and_weights_before_the_wait(pdl: bool):
    constexprs = {"NUM_Q_HEADS": 32, "NUM_HEADS": 36, "HEADS": 8, "HALF": 64, "HAS_NORM": True,
                  "USE_PDL": pdl, "CACHE": _cache(pdl)}  # fmt: skip
    kernel = _compile(triton_rotary._rotate_kernel, ROTARY_ARGS, constexprs, num_warps=4)
    before = _check_pdl(kernel, pdl)
    if pdl:  # the position, then cos and sin from its row, and four weight halves
        assert before.count("LDG.E") >= 7, before.count("LDG.E")
        assert "STG" not in before


@pytest.mark.parametrize("pdl", [False, True])
def test_the_kv_write_loads_its_slot_before_the_wait(pdl: bool) -> None:
    constexprs = {"HEAD_DIM": 128, "IS_FP8": False, "USE_PDL": pdl, "CACHE": _cache(pdl)}
    kernel = _compile(triton_kv_cache._write_kernel, WRITE_ARGS, constexprs, num_warps=1)
    before = _check_pdl(kernel, pdl)
    if pdl:
        assert before.count("LDG.E") >= 1 and "STG" not in before


@pytest.mark.parametrize("pdl", [False, True])
def test_silu_and_mul_reads_nothing_before_the_wait(pdl: bool) -> None:
    """Its only input is the gate/up projection's: under PDL no load precedes the wait, and
    every load after it is from L2."""
    constexprs = {"BLOCK": 2048, "USE_PDL": pdl, "CACHE": _cache(pdl)}
    kernel = _compile(triton_activation._silu_and_mul_kernel, SILU_ARGS, constexprs, num_warps=4)
    before = _check_pdl(kernel, pdl)
    if pdl:
        assert "LDG" not in before and "STG" not in before


def test_the_attention_merge_triggers_after_its_wait() -> None:
    """At batch 1 the split count is 16 (132 SMs, 4 kv heads, 1024 positions planned)."""
    num_splits, _ = triton_attention.plan_splits(1, 4, 1024, 132)
    constexprs = {"NUM_HEADS": 32, "NUM_SPLITS": num_splits, "GROUP": 8, "GROUP_PAD": 16,
                  "HEAD_DIM": 128, "USE_PDL": True}  # fmt: skip
    kernel = _compile(triton_attention._merge_kernel, MERGE_ARGS, constexprs, num_warps=4)
    _check_pdl(kernel, True)


SHAPES = (QKV_SHAPE, O_SHAPE)
GEMV_CASES = [(shape, None) for shape in SHAPES] + [
    (shape, tiles)
    for pair in GEMV_TILES.values()
    for shape, tiles in zip(SHAPES, pair, strict=True)
]


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize(("shape", "tiles"), GEMV_CASES)
def test_the_pdl_gemv_issues_its_prefetch_tile_before_the_wait(shape, tiles, pdl: bool) -> None:
    n, k = shape
    tiles = tiles or triton_gemv.pdl_tiles(n, k)
    constexprs = {"HAS_BIAS": False, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
                  "PREFETCH_K": tiles.prefetch_k, "USE_PDL": pdl}  # fmt: skip
    kernel = _compile(triton_gemv._pdl_gemv_kernel, GEMV_ARGS, constexprs, tiles.num_warps,
                      tiles.num_stages)  # fmt: skip
    before = _check_pdl(kernel, pdl, is_l2_after=False)  # the loop's weights are not .cg
    if pdl:
        per_thread = tiles.block_n * min(tiles.prefetch_k, k) * 2 // (32 * tiles.num_warps * 16)
        assert before.count("LDG.E.128 ") >= per_thread, (before.count("LDG.E.128 "), per_thread)
        assert re.search(r"ld\.global\.cg[.\w]* ", kernel.asm["ptx"]), "x is not read from L2"
