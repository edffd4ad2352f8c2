"""``dormant.install_as_vllm()`` (issue #15, part 1): the imports TRL 1.16 and NeMo-RL make at
start-up resolve to dormant's classes, TRL's version check passes, what dormant lacks raises only
when used, and a real vLLM is never shadowed. Each case runs in a fresh interpreter, since it
registers modules process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_imports_frameworks_make_resolve_to_dormant() -> None:
    result = run("""
        import importlib.util
        import dormant
        module = dormant.install_as_vllm()
        assert dormant.install_as_vllm() is module  # idempotent
        # trl/generation/vllm_generation.py and vllm_client.py (TRL 1.16), import time:
        from vllm import LLM, RequestOutput, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
        from vllm.utils.network_utils import get_ip, get_open_port
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.async_llm import AsyncLLM
        import dormant.engine as engine
        assert LLM is engine.LLM and SamplingParams is engine.SamplingParams
        assert RequestOutput is engine.RequestOutput and AsyncLLM is engine.AsyncLLM
        # trl/import_utils.py: find_spec, then the version in 0.22..0.31
        from packaging.version import Version
        assert importlib.util.find_spec("vllm") is not None
        import vllm
        base = Version(Version(vllm.__version__).base_version)
        assert Version("0.22.0") <= base <= Version("0.31.0")
        assert isinstance(get_open_port(), int) and get_ip() == "127.0.0.1"
        assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_what_dormant_lacks_raises_only_when_used() -> None:
    result = run("""
        import dormant
        dormant.install_as_vllm()
        from vllm.sampling_params import StructuredOutputsParams
        from dormant.engine import UnsupportedSamplingParamsError
        try:
            StructuredOutputsParams(json={})
        except UnsupportedSamplingParamsError:
            print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_real_vllm_is_never_shadowed() -> None:
    result = run("""
        import sys, types
        sys.modules["vllm"] = types.ModuleType("vllm")  # stands for a real, imported vLLM
        import dormant
        from dormant.vllm_compat import VllmAlreadyImportedError
        try:
            dormant.install_as_vllm()
        except VllmAlreadyImportedError as error:
            assert "before anything imports vllm" in str(error)
            print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
