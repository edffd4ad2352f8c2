"""``scripts/gpu_suite.sh tests`` on a machine without the server's packages (the bare GPU
machine): the suite outside ``tests/server`` is collected there, and the script leaves
``tests/server`` out even where it is named. Both stopped a GPU run's collection before
(2026-12-06d, runs 2 and 4). The script runs here with stand-ins for ``python3`` and
``nvidia-smi`` on PATH; the collection runs for real, with the server's packages hidden."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_suite.sh"
BASH = shutil.which("bash") or "/bin/bash"
# The stand-in python3: "-c" (the script's check for the server's packages) answers $HAS_SERVER;
# "-m pytest" records its arguments beside itself.
STAND_IN = """#!/bin/bash
if [[ $1 == -c ]]; then exit "$HAS_SERVER"; fi
if [[ $1 == -m && $2 == pytest ]]; then shift 2; printf '%s\\n' "$@" > "$(dirname "$0")/args"; fi
exit 0
"""
HIDE_SERVER = """
import sys
import pytest

class Hidden:  # a bare machine: none of the server's packages can be imported
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"fastapi", "uvicorn", "openai", "schemathesis"}:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Hidden())
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests",
                      "--ignore=tests/server"]))
"""


def pytest_args(tmp_path: Path, has_server: bool, *paths: str) -> list[str]:
    for name, text in (("python3", STAND_IN), ("nvidia-smi", "#!/bin/bash\necho stand-in\n")):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "HAS_SERVER": "0" if has_server else "1",
    }
    result = subprocess.run(
        [BASH, str(SCRIPT), "tests", *paths],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return (tmp_path / "args").read_text().split()


def test_without_the_server_packages_tests_server_is_left_out_even_where_named(
    tmp_path: Path,
) -> None:
    args = pytest_args(tmp_path, False, "tests/engine", "tests/server", "tests/server/test_cli.py")
    assert "tests/engine" in args and "--ignore=tests/server" in args
    assert not [arg for arg in args if arg.startswith("tests/server")]


def test_with_the_server_packages_every_named_path_runs(tmp_path: Path) -> None:
    args = pytest_args(tmp_path, True, "tests/engine", "tests/server")
    assert args[-2:] == ["tests/engine", "tests/server"]
    assert "--ignore=tests/server" not in args


def test_the_suite_outside_tests_server_is_collected_without_the_server_packages() -> None:
    result = subprocess.run(
        [sys.executable, "-c", HIDE_SERVER],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "tests collected" in result.stdout and "error" not in result.stdout.splitlines()[-1]
