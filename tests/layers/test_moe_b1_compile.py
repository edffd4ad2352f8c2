"""The batch-1 MoE kernels' new variants compiled for the H200 (sm_90) on the CPU, at
Qwen3-30B-A3B's shapes and every tile ``benchmarks/moe_b1_sweep.py`` times: what the
interpreter cannot show (it runs no inline PTX, so never the PDL code).

- no variant spills a register (a spill turns a weight stream into local-memory traffic; the
  router with PDL: at batch 1);
- under PDL each kernel waits (``griddepcontrol.wait``) and triggers its dependent (the down
  kernels: the next layer's norm) only after that wait (``triton_pdl.py``'s rules); the tile
  down kernel issues its weight loads before the wait, in the SASS ptxas emits (what the
  prefetch is for).
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")
from benchmarks.moe_b1_chains import TILE_DOWN, TILE_UP  # noqa: E402
from dormant.layers import triton_moe_direct, triton_router  # noqa: E402
from tests.layers.test_triton_moe_compile import _compile, _router, _spill_bytes  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
GATE_UP_ARGS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "ids_ptr": "*i32",
                "N": "i32", "K": "i32", "stride_x": "i32", "stride_we": "i32",
                "stride_wn": "i32", "stride_h": "i32"}  # fmt: skip
GATE_UP_TILE_ARGS = {key: value for key, value in GATE_UP_ARGS.items() if key != "K"}
DOWN_ARGS = {"h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "weights_ptr": "*fp32",
             "ids_ptr": "*i32", "N": "i32", "stride_h": "i32", "stride_we": "i32",
             "stride_wn": "i32", "stride_out": "i32"}  # fmt: skip


def _sass(kernel) -> str:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        command = [CUOBJDUMP, "-sass", cubin.name]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _check_pdl(kernel, triggers: bool) -> None:
    ptx = kernel.asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == 1
    if triggers:
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
    else:
        assert "griddepcontrol.launch_dependents" not in ptx


@pytest.mark.parametrize("pdl", [False, True])
def test_the_gate_up_and_loop_down_kernels_compile(pdl: bool) -> None:
    up = _compile(triton_moe_direct._gate_up_direct_kernel, GATE_UP_ARGS,
                  {"TOP_K": 8, "BLOCK_N": 16, "BLOCK_K": 256, "USE_PDL": pdl}, 4)  # fmt: skip
    constexprs = {"K": 768, "TOP_K": 8, "BLOCK_N": 4, "BLOCK_K": 256, "USE_PDL": pdl}
    down = _compile(triton_moe_direct._down_combine_kernel, DOWN_ARGS, constexprs, 4)
    assert _spill_bytes(up) == 0 and _spill_bytes(down) == 0
    if pdl:
        _check_pdl(up, triggers=True)
        _check_pdl(down, triggers=True)


def _default_tiles(is_gate_up: bool) -> tuple[int, int]:
    """ "tile-all"'s default (block_n, num_warps) at Qwen3-30B-A3B's gate/up or down."""
    n, k = (768, 2048) if is_gate_up else (2048, 768)
    config = triton_moe_direct.gemv_config(n, k, is_gate_up, "tile-all")
    return config.block_n, config.num_warps


@pytest.mark.parametrize(("block_n", "num_warps"), [_default_tiles(True), *TILE_UP])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_tile_gate_up_kernel_compiles(block_n: int, num_warps: int, pdl: bool) -> None:
    """The whole depth in one tile a program: no spill at any swept tile; under PDL it waits
    for the router's ids before any load, then lets the down kernel launch."""
    kernel = _tile_gate_up(2048, block_n, num_warps, pdl)
    assert _spill_bytes(kernel) == 0
    if pdl:
        _check_pdl(kernel, triggers=True)


@pytest.mark.parametrize("hidden", [1536, 4096, 7168])
def test_the_tile_gate_up_defaults_do_not_spill_at_larger_hidden_sizes(hidden: int) -> None:
    """The default (2 warps, measured at 2048) holds the whole depth without spills at other
    models' hidden sizes too (Qwen3-235B-A22B's 4096, DeepSeek-V3's 7168)."""
    config = triton_moe_direct.gemv_config(768, hidden, True, "tile-all")
    assert _spill_bytes(_tile_gate_up(hidden, config.block_n, config.num_warps, True)) == 0


def _tile_gate_up(hidden: int, block_n: int, num_warps: int, pdl: bool):
    constexprs = {"K": hidden, "K_PAD": triton.next_power_of_2(hidden), "TOP_K": 8,
                  "BLOCK_N": block_n, "USE_PDL": pdl}  # fmt: skip
    return _compile(triton_moe_direct._gate_up_tile_kernel, GATE_UP_TILE_ARGS, constexprs,
                    num_warps)  # fmt: skip


@pytest.mark.parametrize(("block_n", "num_warps"), [_default_tiles(False), *TILE_DOWN])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_tile_down_kernel_compiles_and_prefetches(block_n: int, num_warps: int, pdl: bool):
    constexprs = {"K": 768, "TOP_K": 8, "BLOCK_N": block_n, "K_PAD": 1024, "SLOTS_PAD": 8,
                  "USE_PDL": pdl}  # fmt: skip
    kernel = _compile(triton_moe_direct._down_tile_kernel, DOWN_ARGS, constexprs, num_warps)
    assert _spill_bytes(kernel) == 0
    if pdl:
        _check_pdl(kernel, triggers=True)
        sass = _sass(kernel)
        before = sass[: sass.index("ACQBULK")]  # griddepcontrol.wait in sm_90 SASS
        assert before.count("LDG.E.128 ") >= 1, "no weight load before the wait"


def test_the_router_compiles_with_pdl_at_batch_1() -> None:
    """Its first weights load before the wait; T=1 only: at T=2 the held weights cost 8 bytes
    of spill (ptxas 12.9, sm_90), the batch-1 router is what PDL is for."""
    kernel = _router(1, triton_router.router_config(128, 2048), pdl=True)
    assert _spill_bytes(kernel) == 0
    _check_pdl(kernel, triggers=True)
    sass = _sass(kernel)
    assert sass[: sass.index("ACQBULK")].count("LDG.E"), "no weight load before the wait"
