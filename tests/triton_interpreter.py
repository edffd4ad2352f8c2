"""Runs a script under Triton's interpreter, on the CPU, in a fresh Python process: the tests of
the Triton kernels that need no GPU use it (``TRITON_INTERPRET`` is read when triton is imported,
so the interpreter needs its own process).

Triton 3.6's interpreter turns a loop bound that is a kernel value (``range(start, end)`` with
``start`` from ``tl.program_id``) into a Python int with ``int()`` of a one-element array, which
NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars";
triton-lang/triton#9171, fixed upstream by squeezing the array first). The script runs after a
prelude that does the same squeeze, when the installed interpreter has the old conversion.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_PRELUDE = """
import triton.runtime.interpreter as _interpreter

_patch_lang_tensor = _interpreter._patch_lang_tensor


def _squeezed_index(tensor, scope):  # triton-lang/triton#9171 (NumPy 2.4)
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))


_interpreter._patch_lang_tensor = _squeezed_index
"""


def run_interpreted(script: str, timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` with ``TRITON_INTERPRET=1`` from the repository's root (its modules
    importable); skips the calling test where Triton is not installed. The caller checks the
    return code and output."""
    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    command = [sys.executable, "-c", _PRELUDE + script]
    return subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
