"""``scripts/with_mps.sh`` on the CPU, with a stand-in ``nvidia-cuda-mps-control`` on PATH: the
command runs with the daemon's private pipe and log folders in its environment, its exit status
comes back, and the daemon is told to quit; without the control binary the script refuses with
a clear message and runs nothing."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "with_mps.sh"
BASH, TOUCH = shutil.which("bash") or "/bin/bash", shutil.which("touch") or "/usr/bin/touch"
# The stand-in daemon: "-d" starts it (it logs a server start as the real one does once a client
# connects); "quit" on stdin is recorded beside the script.
STAND_IN = """#!/bin/bash
if [[ ${1:-} == -d ]]; then
  echo "Starting new server 1 for user 0" > "$CUDA_MPS_LOG_DIRECTORY/control.log"
  echo "NEW CLIENT 2 from user 0" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
  exit 0
fi
read -r line && echo "$line" >> "$(dirname "$0")/received"
"""


def run(path: str, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        [BASH, str(SCRIPT), *command], env=env, capture_output=True, text=True, check=False
    )


def test_the_command_runs_under_the_daemon_and_its_status_comes_back(tmp_path: Path) -> None:
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(STAND_IN)
    control.chmod(0o755)
    seen = tmp_path / "seen"
    result = run(
        f"{tmp_path}:{os.environ['PATH']}",
        "bash", "-c", f'echo "$CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" > {seen}; exit 7',
    )  # fmt: skip
    assert result.returncode == 7
    pipe, log = seen.read_text().split()
    assert pipe.startswith("/tmp/dormant-mps.") and log.startswith("/tmp/dormant-mps.")
    assert not Path(pipe).exists()  # the private folders are removed after the quit
    assert (tmp_path / "received").read_text() == "quit\n"
    assert "exit status 7; MPS servers started: 1; clients: 1" in result.stderr


def test_without_the_control_binary_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = run(str(tmp_path), TOUCH, str(marker))  # a PATH with no control binary on it
    assert result.returncode == 3
    assert "nvidia-cuda-mps-control is not on this machine" in result.stderr
    assert not marker.exists()


def test_a_daemon_that_fails_to_start_leaves_nothing_behind(tmp_path: Path) -> None:
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/bash\nexit 1\n")
    control.chmod(0o755)
    marker = tmp_path / "ran"
    before = set(Path("/tmp").glob("dormant-mps.*"))
    result = run(f"{tmp_path}:{os.environ['PATH']}", TOUCH, str(marker))
    assert result.returncode == 3
    assert not marker.exists()
    assert set(Path("/tmp").glob("dormant-mps.*")) == before  # its folders were removed


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGHUP], ids=["TERM", "HUP"])
def test_a_signal_to_the_script_stops_the_command_and_the_daemon_quits(
    tmp_path: Path, sent: signal.Signals
) -> None:
    """A signal sent to the script alone (not to its process group, as ``timeout`` sends it)
    reaches the command too: it must not run on orphaned (it would write the marker after 3 s),
    and the daemon is told to quit."""
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(STAND_IN)
    control.chmod(0o755)
    marker = tmp_path / "finished"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    script = subprocess.Popen(
        [BASH, str(SCRIPT), BASH, "-c", f"sleep 3; touch {marker}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(1.0)
    script.send_signal(sent)
    assert script.wait(timeout=20) != 0
    assert (tmp_path / "received").read_text() == "quit\n"
    time.sleep(3.0)
    assert not marker.exists(), "the command ran on after the script was stopped"
