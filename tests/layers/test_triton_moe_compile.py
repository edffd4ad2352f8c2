"""The decode kernels of the MoE model compiled for the H200 (sm_90) on the CPU, with Triton's
own compiler and the ptxas it ships: what the interpreter cannot show before a GPU run.

- every default tile of the fused router and the skinny GEMV at Qwen3-30B-A3B's shapes, T 1..4,
  compiles and spills no register (a spill turns a weight stream into local-memory traffic);
- the router's last program loads the logits in the layout ``topk_softmax``'s kernel does (one
  warp, 4 per thread), so its float32 sums run in the same order: given the same logits, both
  give the same bits on the GPU too;
- the ticket is an acq_rel atomic at GPU scope.

Arguments are specialised as the JIT does for these shapes (pointers and sizes divisible by 16).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dormant.layers import triton_gemv, triton_moe_routing, triton_router  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
H200 = GPUTarget("cuda", 90, 32)
ROUTER_ARGS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "logits_ptr": "*fp32", "weights_ptr": "*fp32",
               "ids_ptr": "*i32", "ticket_ptr": "*i32", "num_experts": "i32", "hidden": "i32",
               "stride_x": "i32", "stride_w": "i32"}  # fmt: skip
GEMV_ARGS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32",
             "K": "i32", "stride_x": "i32", "stride_w": "i32", "stride_y": "i32"}  # fmt: skip
TOPK_ARGS = {"logits_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
             "stride_logits": "i32", "num_experts": "i32"}  # fmt: skip


def _compile(fn, args: dict[str, str], constexprs: dict[str, object], num_warps: int,
             num_stages: int = 3):  # fmt: skip
    signature = {**args, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(args))}  # as the JIT specialises
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=H200, options=options)


def _spill_bytes(kernel) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        command = [PTXAS, "-v", "-arch=sm_90a", ptx.name, "-o", os.devnull]
        report = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))


def _router(num_tokens: int, config: triton_router.RouterConfig, pdl: bool = False):
    constexprs = {"NUM_TOKENS": num_tokens, "BLOCK_E": config.block_e, "BLOCK_K": config.block_k,
                  "EXPERTS_PAD": 128, "TOP_K": 8, "TOP_K_PAD": 8, "RENORMALIZE": True,
                  "USE_PDL": pdl}  # fmt: skip
    return _compile(triton_router._router_topk_kernel, ROUTER_ARGS, constexprs, num_warps=1)


def _logits_layouts(ttgir: str) -> set[str]:
    """The layouts of the [128] float32 logits loads."""
    layouts = dict(re.findall(r"(#blocked\d*) = #ttg.blocked<([^>]*)>", ttgir))
    loads = re.findall(r"tt.load [^\n]*tensor<128x!tt.ptr<f32>, (#blocked\d*)>", ttgir)
    return {layouts[name] for name in loads}


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4])
def test_the_router_and_gemv_compile_for_the_h200_without_spills(num_tokens: int) -> None:
    kernel = _router(num_tokens, triton_router.router_config(128, 2048))
    assert _spill_bytes(kernel) == 0
    assert "atom.global.gpu.acq_rel.add" in kernel.asm["ptx"]
    for n, k in ((5120, 2048), (2048, 4096)):  # QKV, O
        tiles = triton_gemv.gemv_tiles(num_tokens, n, k)
        constexprs = {
            "NUM_TOKENS": num_tokens, "TOKENS_PAD": triton.next_power_of_2(num_tokens),
            "HAS_BIAS": False, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
        }  # fmt: skip
        gemv = _compile(triton_gemv._skinny_gemv_kernel, GEMV_ARGS, constexprs, tiles.num_warps,
                        tiles.num_stages)  # fmt: skip
        assert _spill_bytes(gemv) == 0, (n, k, tiles)
        assert "ld.global.v4" in gemv.asm["ptx"], "the weights load 16 bytes at a time"


def test_the_router_routes_with_topk_softmaxs_layout() -> None:
    constexprs = {"EXPERTS_PAD": 128, "TOP_K": 8, "TOP_K_PAD": 8, "RENORMALIZE": True}
    topk = _compile(triton_moe_routing._topk_softmax_kernel, TOPK_ARGS, constexprs, num_warps=1)
    expected = _logits_layouts(topk.asm["ttgir"])
    assert len(expected) == 1, expected
    for num_tokens in (1, 4):
        router = _router(num_tokens, triton_router.router_config(128, 2048))
        assert _logits_layouts(router.asm["ttgir"]) == expected
