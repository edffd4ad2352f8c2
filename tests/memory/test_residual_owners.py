"""The residual's owner rows (issue 20: NCCL attributed): a phase marked with an owner is that
owner's row; ``carve`` moves an owner's bytes out of the context's row; ``returned`` shrinks
the owner's row and the "since" row shows the memory gone. Every case still adds up to the
device's used bytes. Scripted samples stand in for the driver (the CPU has none)."""

from __future__ import annotations

import pytest

from dormant.memory import MemoryManager
from dormant.memory.residual import ResidualLedger, Sample
from dormant.memory.torch_usage import TorchUsage

MiB = 2**20
NCCL = "NCCL communicator"


class Scripted:
    """Process memory in use at each next sample: a list consumed in order (the last repeats)."""

    def __init__(self, used: list[int]) -> None:
        self.used = used

    def __call__(self, label: str, owner: str | None = None) -> Sample:
        used = self.used.pop(0) if len(self.used) > 1 else self.used[0]
        return Sample(label, used, 80 << 30, used, TorchUsage(4 * MiB, 6 * MiB), 0, None, owner)


def ledger(monkeypatch: pytest.MonkeyPatch, used: list[int]) -> ResidualLedger:
    residual = MemoryManager("cpu").residual
    sample = Scripted(used)
    monkeypatch.setattr(residual, "sample", sample)
    monkeypatch.setattr(residual, "is_cuda", True)
    residual.samples = [sample("the manager started")]
    return residual


def rows(residual: ResidualLedger) -> dict[str, int]:
    now, items = residual.items()
    found = {item.owner: item.nbytes for item in items}
    assert sum(found.values()) == now.device_used_bytes  # the rows partition the used bytes
    return found


def by_start(found: dict[str, int], start: str) -> int:
    (value,) = [nbytes for owner, nbytes in found.items() if owner.startswith(start)]
    return value


def test_a_marked_owner_is_its_own_row(monkeypatch: pytest.MonkeyPatch) -> None:
    residual = ledger(monkeypatch, [500 * MiB, 500 * MiB, 800 * MiB, 900 * MiB])
    residual.mark("the worker started")
    residual.mark("the communicator was made", owner=NCCL)
    found = rows(residual)
    assert found[NCCL] == 300 * MiB
    assert by_start(found, "grew since the communicator was made") == 100 * MiB


def test_what_an_owner_gives_back_leaves_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    residual = ledger(monkeypatch, [500 * MiB, 800 * MiB, 900 * MiB, 650 * MiB])
    residual.mark("the communicator was made", owner=NCCL)
    residual.mark("the model was loaded")
    residual.returned(NCCL, 250 * MiB)  # suspended: now's sample is 250 MiB lower
    found = rows(residual)
    assert by_start(found, NCCL) == 50 * MiB
    (owner,) = [o for o in found if o.startswith(NCCL)]
    assert owner.endswith("(250.0 MiB of it given back while asleep)")
    assert by_start(found, "grew while the model was loaded") == 100 * MiB
    assert not any(o.startswith("grew since") for o in found)  # 0 once given back: left out
    residual.returned(NCCL, -250 * MiB)  # resumed: taken back
    assert by_start(rows(residual), NCCL) == 300 * MiB


def test_carved_bytes_leave_the_context_row_and_merge_with_a_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    residual = ledger(monkeypatch, [700 * MiB, 700 * MiB, 710 * MiB, 710 * MiB])
    residual.carve(NCCL, 200 * MiB)  # made before the manager: measured by the caller
    residual.mark("the worker started")
    residual.mark("the communicator was made", owner=NCCL)  # a second collective: 10 MiB more
    found = rows(residual)
    assert found[NCCL] == 210 * MiB  # one row
    context = by_start(found, "CUDA context")
    assert context == 700 * MiB - 6 * MiB - 200 * MiB  # less torch's reserved and the carve


def test_unmeasured_figures_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    residual = ledger(monkeypatch, [500 * MiB])
    before = rows(residual)
    residual.carve(NCCL, None)
    residual.returned(NCCL, None)
    assert rows(residual) == before
