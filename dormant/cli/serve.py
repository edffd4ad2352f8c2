"""``dormant serve MODEL``: the HTTP server (OpenAI, vLLM and SGLang routes; see
``dormant.server.app``). Everything a newcomer can get wrong is checked before the model
loads, and answered with one line and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dormant.cli.checks import UsageError, check_device, check_model_dir

DTYPES = ("auto", "bfloat16", "float16", "float32")
# Engine options on the command line, as vLLM spells them: (flag, type, default, help).
ENGINE_OPTIONS: list[tuple[str, Any, Any, str]] = [
    ("--device", str, "auto", "where to run: auto (a GPU if there is one), cuda or cpu"),
    ("--dtype", str, "auto", "weight dtype: auto (the checkpoint's), bfloat16, float16, float32"),
    ("--kv-cache-dtype", str, "auto", "KV cache dtype: auto (the weights') or fp8"),
    ("--max-model-len", int, None, "longest sequence, prompt included (default: the model's)"),
    ("--max-num-seqs", int, None, "most sequences generated at once (default: the engine's)"),
    ("--gpu-memory-utilization", float, None, "share of the GPU the engine may use (0-1]"),
    ("--kv-cache-memory-bytes", int, None, "bytes for the KV cache (instead of a share)"),
    ("--tensor-parallel-size", int, None, "GPUs per engine, one worker process each"),
    ("--seed", int, None, "seed of the engine's random draws"),
    ("--tokenizer", str, None, "tokenizer directory (default: the model's)"),
    ("--load-format", str, None, "auto (the checkpoint), or dummy for random weights"),
    ("--logprobs-mode", str, None, "raw_logprobs (default), processed_logprobs, raw_logits..."),
    ("--max-logprobs", int, None, "most logprobs a request may ask for (-1: the vocabulary)"),
    ("--generation-config", str, None, "unset sampling fields from: auto (the model's), vllm"),
    ("--override-generation-config", str, None, "JSON of sampling defaults over the model's"),
    (
        "--weight-transfer-config",
        str,
        None,
        'vLLM\'s weight-transfer routes: \'{"backend": "nccl"}\'',
    ),
]


def add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI, vLLM and SGLang routes)",
        description="Serves a Hugging Face model directory over HTTP. Binds 127.0.0.1 unless "
        "told otherwise; admin routes (sleep, wake, refit) need --admin-token off loopback.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("model", help="a Hugging Face model directory (with config.json)")
    net = serve.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: everywhere)")
    net.add_argument("--port", type=int, default=8000, help="port to bind (0: a free one)")
    net.add_argument("--served-model-name", nargs="+", default=None,
                     help="names clients use in 'model' (default: the model path)")  # fmt: skip
    sec = serve.add_argument_group("security")
    sec.add_argument("--api-key", default=os.environ.get("DORMANT_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on every route (env "
                          "DORMANT_API_KEY)")  # fmt: skip
    sec.add_argument("--admin-token", default=os.environ.get("DORMANT_ADMIN_TOKEN"),
                     help="token for admin routes: sleep, wake, pause, refit, collective_rpc "
                          "(env DORMANT_ADMIN_TOKEN)")  # fmt: skip
    sec.add_argument("--insecure-admin", action="store_true",
                     help="allow admin routes without a token on a non-loopback bind")  # fmt: skip
    sec.add_argument("--allowed-weight-dirs", nargs="*", default=[],
                     help="directories /update_weights_from_disk may read below (none: it "
                          "refuses every path)")  # fmt: skip
    sec.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=[],
        help="extra Host names to accept (besides loopback and the bind address)",
    )
    lim = serve.add_argument_group("limits")
    lim.add_argument("--max-body-bytes", type=int, default=16 << 20, help="largest request body")
    lim.add_argument("--max-prompt-chars", type=int, default=None,
                     help="longest text prompt (default: max-model-len x 32)")  # fmt: skip
    lim.add_argument("--max-sequences-per-request", type=int, default=4096,
                     help="prompts x n one request may start")  # fmt: skip
    lim.add_argument("--max-connections", type=int, default=256, help="connections at once")
    lim.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a client may take to send its request head")  # fmt: skip
    lim.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a client may take to send its request body")  # fmt: skip
    lim.add_argument("--keep-alive-timeout", type=int, default=5,
                     help="seconds an idle connection stays open")  # fmt: skip
    sleep = serve.add_argument_group("sleep and refit")
    sleep.add_argument(
        "--sleep-idle-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="sleep (level 1) after this many idle seconds (default: never)",
    )
    sleep.add_argument(
        "--auto-wake",
        action="store_true",
        help="wake a level-1 sleep when a generation request arrives",
    )
    sleep.add_argument("--refit-policy", choices=("wait", "abort"), default="wait",
                       help="what a refit does with running requests: let them finish first, "
                            "or abort them")  # fmt: skip
    eng = serve.add_argument_group("engine")
    eng.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    eng.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue the next decode call before reading the one in flight (vLLM's; default: "
        "on where it applies, one in-process rank without speculative decoding)",
    )
    for flag, kind, default, text in ENGINE_OPTIONS:
        eng.add_argument(flag, type=kind, default=default, help=text)


def run_serve(args: argparse.Namespace) -> int:
    """Checks, binds, loads, serves; a problem before serving is one line and exit code 2."""
    try:
        return _serve(args)
    except UsageError as error:
        print(f"dormant serve: {error}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    check_model_dir(args.model, allow_random=args.load_format == "dummy")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    check_device(args.device)
    try:
        from dormant.server import ServerSettings, build_app, uvicorn_config
        from dormant.server.app import StoppableServer, bind_socket
    except ImportError as error:
        raise UsageError(
            f"the server needs its extra dependencies ({error.name} is missing): "
            "pip install 'dormant[serve]'"
        ) from error
    try:
        sock = bind_socket(args.host, args.port)  # before the model loads: fail fast
    except OSError as error:
        raise UsageError(
            f"cannot listen on {args.host}:{args.port} ({error.strerror}); pick another "
            "--port (0 picks a free one) or stop what uses it"
        ) from error
    engine = _load_engine(args, sock)
    names = tuple(args.served_model_name or [args.model])
    try:
        settings = ServerSettings(
            served_model_names=names, host=args.host, port=sock.getsockname()[1],
            api_key=args.api_key, admin_token=args.admin_token,
            insecure_admin=args.insecure_admin,
            allowed_weight_dirs=tuple(Path(d) for d in args.allowed_weight_dirs),
            allowed_hosts=tuple(args.allowed_hosts), max_body_bytes=args.max_body_bytes,
            max_prompt_chars=args.max_prompt_chars,
            max_sequences_per_request=args.max_sequences_per_request,
            max_connections=args.max_connections,
            header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
            keep_alive_s=args.keep_alive_timeout, sleep_idle_ttl_s=args.sleep_idle_ttl,
            auto_wake=args.auto_wake,
        )  # fmt: skip
    except ValueError as error:
        engine.shutdown()
        sock.close()
        raise UsageError(str(error)) from error
    server = StoppableServer(uvicorn_config(build_app(engine, settings), settings))
    host, port = sock.getsockname()[:2]
    print(f"dormant: serving {args.model} on http://{host}:{port}/v1", flush=True)
    try:
        server.run(sockets=[sock])  # uvicorn stops cleanly on SIGINT and SIGTERM
    finally:
        engine.shutdown()
        sock.close()
    return 0


def _load_engine(args: argparse.Namespace, sock: Any) -> Any:
    from dormant.core.errors import EngineError
    from dormant.engine.async_llm import AsyncLLM

    options = {
        flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
        for flag, *_ in ENGINE_OPTIONS
    }
    options["async_scheduling"] = args.async_scheduling
    options = {name: value for name, value in options.items() if value is not None}
    try:
        return AsyncLLM(
            args.model,
            refit_policy=args.refit_policy,
            enforce_eager=args.enforce_eager,
            enable_sleep_mode=True,
            **options,
        )
    except (EngineError, ValueError, TypeError, OSError) as error:
        sock.close()
        raise UsageError(f"cannot load {args.model!r}: {error}") from error
