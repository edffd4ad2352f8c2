"""``dormant serve MODEL``: the OpenAI-compatible server (see ``dormant.server.app``)."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

# Engine options on the command line, as vLLM spells them: (flag, type, help).
ENGINE_OPTIONS: list[tuple[str, type, str]] = [
    ("--device", str, "auto (GPU if there is one), cuda, cpu"),
    ("--dtype", str, "auto, bfloat16, float16, float32"),
    ("--kv-cache-dtype", str, "auto or fp8"),
    ("--max-model-len", int, "longest sequence, prompt included"),
    ("--max-num-seqs", int, "most sequences running at once"),
    ("--gpu-memory-utilization", float, "share of the GPU the engine may use"),
    ("--tensor-parallel-size", int, "GPUs per engine (one worker process each)"),
    ("--seed", int, "seed of the engine's random draws"),
    ("--tokenizer", str, "tokenizer directory (default: the model's)"),
    ("--load-format", str, "auto, or dummy for random weights"),
]


def add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible server with sleep endpoints")
    serve.add_argument("model", help="a Hugging Face model directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="default: the model path")
    serve.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    for flag, kind, text in ENGINE_OPTIONS:
        serve.add_argument(flag, type=kind, default=None, help=text)


def run_serve(args: argparse.Namespace) -> int:
    from dormant import LLM
    from dormant.server import DormantServer

    options = {
        flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
        for flag, _, _ in ENGINE_OPTIONS
    }
    options = {name: value for name, value in options.items() if value is not None}
    llm = LLM(args.model, enforce_eager=args.enforce_eager, **options)
    server = DormantServer((args.host, args.port), llm, args.served_model_name or args.model)
    host, port = server.server_address[:2]
    # SIGTERM (what process managers send) stops the server as Ctrl-C does: shutdown() waits
    # for serve_forever to return, so it must run on another thread than the handler's.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"dormant: serving {args.model} on http://{host}:{port}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        llm.shutdown()
    return 0
