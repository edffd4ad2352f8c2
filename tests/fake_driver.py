"""A fake ``libcuda.so.1`` with the driver's process-checkpoint API (``memory/fake_libcuda.c``),
for CPU tests of the zero-residual mode: the checkpoint helper process loads it through
``LD_LIBRARY_PATH``, which the dynamic linker searches before the system's libraries.

``fake_driver`` builds it (skips without gcc), points ``LD_LIBRARY_PATH`` at it and gives the
test a ``FakeDriver`` that reads the calls the helper made and sets the fake's behaviour.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE = Path(__file__).parent / "memory" / "fake_libcuda.c"
NVML_SOURCE = Path(__file__).parent / "memory" / "fake_libnvml.c"


def build(directory: Path, *, with_api: bool = True) -> Path:
    """Compiles the fake into ``directory/libcuda.so.1``, and the fake NVML next to it
    (``libnvidia-ml.so.1``); returns the directory."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the fake libcuda")
    directory.mkdir(parents=True, exist_ok=True)
    flags = [] if with_api else ["-DNO_CHECKPOINT_API"]
    for source, name in ((SOURCE, "libcuda.so.1"), (NVML_SOURCE, "libnvidia-ml.so.1")):
        out = str(directory / name)
        subprocess.run([compiler, "-shared", "-fPIC", *flags, "-o", out, str(source)], check=True)
    return directory


@dataclass
class FakeDriver:
    log: Path
    monkeypatch: pytest.MonkeyPatch

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def calls(self) -> list[str]:
        """Each checkpoint call the fake received: "<op> <pid> [<lock timeout ms>]"."""
        return [line for line in self.lines() if not line.startswith("nvml ")]

    def nvml_readers(self) -> list[int]:
        """The pid of the process behind each NVML process query."""
        return [int(line.split()[1]) for line in self.lines() if line.startswith("nvml ")]

    def ops(self) -> list[str]:
        return [line.split()[0] for line in self.calls()]

    def set_nvml(self, pid: int, process_bytes: int, used_bytes: int) -> None:
        """What the fake NVML reports: the device runs ``pid`` with ``process_bytes``."""
        self.monkeypatch.setenv("FAKE_NVML_PROCESS", f"{pid}:{process_bytes}")
        self.monkeypatch.setenv("FAKE_NVML_USED", str(used_bytes))

    def set(self, **behaviour: str) -> None:
        """``fail=``, ``hang=``, ``exit=`` an op, or ``version=`` (see fake_libcuda.c); takes
        effect in the next helper process started."""
        for key, value in behaviour.items():
            self.monkeypatch.setenv(f"FAKE_CUDA_{key.upper()}", value)


@pytest.fixture(scope="session")
def fake_libraries(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fake with the API, the fake of a driver before 570)."""
    root = tmp_path_factory.mktemp("fake_libcuda")
    return build(root / "api"), build(root / "no_api", with_api=False)


@pytest.fixture
def fake_driver(
    fake_libraries: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeDriver]:
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_libraries[0]))
    log = tmp_path / "fake_cuda.log"
    monkeypatch.setenv("FAKE_CUDA_LOG", str(log))
    for key in (
        "CUDA_FAIL", "CUDA_HANG", "CUDA_EXIT", "CUDA_VERSION", "NVML_PROCESS", "NVML_USED",
        "NVML_MPS_CLIENT",
    ):  # fmt: skip
        monkeypatch.delenv(f"FAKE_{key}", raising=False)
    yield FakeDriver(log, monkeypatch)


@pytest.fixture
def old_driver(fake_libraries: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A libcuda without the checkpoint API (a display driver before 570)."""
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_libraries[1]))
