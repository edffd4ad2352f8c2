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
# The stand-in python3: "-c 'import a, b'" (the script's check for the server's packages)
# succeeds when every module named is in $HAVE; "-m pytest" records its arguments beside itself.
STAND_IN = """#!/bin/bash
if [[ $1 == -c ]]; then
  for module in $(echo "${2#import }" | tr ',' ' '); do
    [[ " $HAVE " == *" $module "* ]] || exit 1
  done
  exit 0
fi
if [[ $1 == -m && $2 == pytest ]]; then shift 2; printf '%s\\n' "$@" > "$(dirname "$0")/args"; fi
exit 0
"""
# The server's own packages (scripts/gpu_suite.sh's header lists the wheels that bring them)
SERVER = "fastapi uvicorn"
HIDE = """
import importlib.util
import sys
import pytest

hidden, *args = sys.argv[1:]
hidden = set(hidden.split())

class Hidden:  # as if not installed: importing them raises
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

find_spec = importlib.util.find_spec  # and asking for their spec answers None
importlib.util.find_spec = lambda name, *rest: (
    None if name.split(".")[0] in hidden else find_spec(name, *rest)
)
sys.meta_path.insert(0, Hidden())
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args]))
"""


def run_script(tmp_path: Path, have: str, *paths: str) -> subprocess.CompletedProcess:
    for name, text in (("python3", STAND_IN), ("nvidia-smi", "#!/bin/bash\necho stand-in\n")):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "HAVE": have,
    }
    return subprocess.run(
        [BASH, str(SCRIPT), "tests", *paths],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip


def pytest_args(tmp_path: Path, have: str, *paths: str) -> list[str]:
    result = run_script(tmp_path, have, *paths)
    assert result.returncode == 0, result.stdout + result.stderr
    return (tmp_path / "args").read_text().split()


def collect(hidden: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HIDE, hidden, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def test_without_the_server_packages_tests_server_is_left_out_even_where_named(
    tmp_path: Path,
) -> None:
    args = pytest_args(tmp_path, "", "tests/engine", "tests/server", "tests/server/test_cli.py")
    assert "tests/engine" in args and "--ignore=tests/server" in args
    assert not [arg for arg in args if arg.startswith("tests/server")]


def test_with_only_tests_server_named_and_no_server_nothing_runs(tmp_path: Path) -> None:
    """Not the whole suite (pytest's fallback when no path is left), which outlasts a call."""
    result = run_script(tmp_path, "", "tests/server")
    assert result.returncode != 0 and "nothing left to run" in result.stdout
    assert not (tmp_path / "args").exists()


def test_with_the_server_packages_every_named_path_runs(tmp_path: Path) -> None:
    args = pytest_args(tmp_path, SERVER, "tests/engine", "tests/server")
    assert args[-2:] == ["tests/engine", "tests/server"]
    assert "--ignore=tests/server" not in args


def test_the_suite_outside_tests_server_is_collected_without_the_server_packages() -> None:
    result = collect("fastapi uvicorn openai schemathesis", "tests", "--ignore=tests/server")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "tests collected" in result.stdout and "error" not in result.stdout.splitlines()[-1]


def test_tests_server_is_collected_with_the_server_packages_alone() -> None:
    """Without the official client and schemathesis (the wheels the GPU machine is sent), their
    two modules are left out and the rest of tests/server is collected."""
    result = collect("openai schemathesis", "tests/server")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "test_server_devices.py" in result.stdout
    assert "test_clients.py" not in result.stdout and "test_schemathesis.py" not in result.stdout
