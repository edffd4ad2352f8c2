"""The command line as a newcomer meets it: one-line errors with exit code 2 (never a
traceback), the port checked before the model loads, ``--version``, ``python -m dormant``, and
``dormant serve`` end to end, stopped by Ctrl-C and by SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.server.conftest import GREEDY, PROMPTS


def dormant(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dormant", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines, result.stderr
    assert all(w in result.stderr for w in words), result.stderr


def test_version_and_help() -> None:
    result = dormant("--version")
    assert result.returncode == 0 and re.match(r"dormant \d", result.stdout)
    help_text = dormant("serve", "--help").stdout
    for flag in ("--api-key", "--admin-token", "--allowed-weight-dirs", "--sleep-idle-ttl",
                 "--auto-wake", "--max-body-bytes", "--header-timeout"):  # fmt: skip
        assert flag in help_text
    assert "(default: 127.0.0.1)" in " ".join(help_text.split()) and "``" not in help_text


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["serve", "/no/such/model"], ["does not exist"]),
        (["serve", "/"], ["no config.json"]),
        (["serve", "{model}", "--dtype", "fp7"], ["--dtype", "bfloat16"]),
        (["serve", "{model}", "--device", "gpu"], ["--device", "cuda"]),
        (["demo", "--device", "gpu"], ["gpu"]),
    ],
)
def test_mistakes_get_one_line_and_exit_code_2(model_dir, args, words) -> None:
    assert_one_line_error(dormant(*(a.format(model=model_dir) for a in args)), *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("command", [["demo"], ["serve", "{model}"]])
def test_cuda_without_a_gpu_is_one_clear_line(model_dir, command) -> None:
    args = [a.format(model=model_dir) for a in command]
    assert_one_line_error(dormant(*args, "--device", "cuda"), "no CUDA GPU")


def test_a_busy_port_is_reported_before_the_model_loads(model_dir) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = dormant("serve", str(model_dir), "--port", str(port), "--device", "cpu")
    assert_one_line_error(result, f"127.0.0.1:{port}", "--port")


@pytest.mark.parametrize("stop_signal", ["SIGINT", "SIGTERM"])
def test_dormant_serve_end_to_end(model_dir: Path, stop_signal: str) -> None:
    command = [sys.executable, "-m", "dormant", "serve", str(model_dir), "--port", "0",
               "--device", "cpu", "--max-model-len", "128", "--served-model-name", "cli",
               "--kv-cache-memory-bytes", str(4 << 20)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"http://(127\.0\.0\.1):(\d+)/v1", line)
        assert match, line + (process.stderr.read() if process.poll() is not None else "")
        url = f"http://{match[1]}:{match[2]}"
        with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as reply:
            card = json.loads(reply.read())["data"][0]
        assert card["id"] == "cli" and card["max_model_len"] == 128
        body = json.dumps({"prompt": PROMPTS[0], **GREEDY}).encode()
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:  # fmt: skip
            assert json.loads(reply.read())["usage"]["completion_tokens"] == 12
    finally:
        process.send_signal(getattr(signal, stop_signal))
        assert process.wait(timeout=60) == 0
    assert "Traceback" not in process.stderr.read()


def test_import_and_the_demo_parser_need_no_server_dependencies() -> None:
    """``import dormant`` and ``dormant demo`` work without the serve extra."""
    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'prometheus_client', 'starlette'):\n"
        "    sys.modules[name] = None\n"
        "import dormant, dormant.cli\n"
        "from dormant import LLM\n"
        "dormant.cli.build_parser().parse_args(['demo', '--device', 'cpu'])\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)],
)
def test_async_scheduling_reaches_the_engine(monkeypatch, model_dir, flags, expected) -> None:
    """vLLM's ``--async-scheduling`` / ``--no-async-scheduling``; unset, the engine decides."""
    import dormant.engine.async_llm
    from dormant.cli import build_parser
    from dormant.cli.serve import _load_engine

    seen: dict[str, object] = {}
    monkeypatch.setattr(dormant.engine.async_llm, "AsyncLLM", lambda *a, **k: seen.update(k))
    args = build_parser().parse_args(["serve", str(model_dir), *flags])
    _load_engine(args, sock=None)
    assert seen.get("async_scheduling") == expected


def test_vllms_rl_flags_reach_the_engine(monkeypatch, model_dir) -> None:
    """The flags ``trl vllm-serve`` passes to ``vllm serve`` (--logprobs-mode, --max-logprobs,
    --weight-transfer-config) and the generation-config pair, as engine options."""
    import dormant.engine.async_llm
    from dormant.cli import build_parser
    from dormant.cli.serve import _load_engine

    seen: dict[str, object] = {}
    monkeypatch.setattr(dormant.engine.async_llm, "AsyncLLM", lambda *a, **k: seen.update(k))
    flags = ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
             "--weight-transfer-config", '{"backend": "nccl"}', "--generation-config", "vllm",
             "--override-generation-config", '{"temperature": 0.5}']  # fmt: skip
    _load_engine(build_parser().parse_args(["serve", str(model_dir), *flags]), sock=None)
    assert seen["logprobs_mode"] == "processed_logprobs" and seen["max_logprobs"] == -1
    assert seen["weight_transfer_config"] == '{"backend": "nccl"}'
    assert seen["generation_config"] == "vllm"
    assert seen["override_generation_config"] == '{"temperature": 0.5}'
