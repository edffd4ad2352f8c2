"""Zero residual, opt-in (issue 17, section 4): ``sleep(level=2, release_context=True)`` on the
first engine of a fresh process. While it sleeps, the driver's own accounting (NVML, read by
this process, which never touches CUDA) shows no device memory for it; it wakes (the restore
first), refits and generates the same tokens; the extra sleep and wake costs against a plain
level-2 cycle are printed. Skipped, with the driver's reason, where the driver lacks the
checkpoint API (display driver < 570)."""

from __future__ import annotations

import json

import pytest

from benchmarks.residual import run_case

pytestmark = pytest.mark.gpu
MiB = 1 << 20
DEVICE_SLACK = 16 * MiB  # NVML's device-wide figure moves by the driver's own bookkeeping


def test_the_gpu_shows_nothing_for_a_released_engine() -> None:
    result = run_case("release", timeout_s=300.0)  # a hang fails, naming its phase
    if "unsupported" in result:
        pytest.skip(result["unsupported"])
    print(json.dumps({k: v for k, v in result.items() if k != "status_asleep"}, indent=1))
    print(result["status_asleep"])
    view = result["parent_nvml"]
    if view["child_listed_while_awake"]:
        assert view["child_process_bytes"] == 0, view
    else:  # a PID namespace hides the child's pid: the device against before the child was
        before, asleep = view["device_used_before_child_bytes"], view["device_used_bytes"]
        assert before is not None and asleep is not None, f"no NVML reading: {view}"
        assert asleep - before <= DEVICE_SLACK, view
    assert result["tokens_equal"]
    context = result["context"]
    assert context is not None and not context["is_released"] and context["restore_s"] > 0
