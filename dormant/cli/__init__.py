"""The ``dormant`` command line; it uses public APIs only (``dormant.LLM``, ``AsyncLLM``)."""

from __future__ import annotations

import argparse
import sys

from dormant.cli.checks import DEVICES, UsageError, check_device
from dormant.cli.serve import add_serve_parser, run_serve


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("dormant")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dormant",
        description="dormant: an LLM inference engine whose GPU memory sleeps and wakes. "
        "Try 'dormant demo' first.",
    )
    parser.add_argument("--version", action="version", version=f"dormant {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run an RL-style sleep/wake/refit cycle on a small random model",
        description="Runs the cycle an RL trainer colocated with dormant runs, on a random "
        "model, checks the tokens, and writes a memory timeline (PNG).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--device", default="auto", choices=DEVICES,
                      help="where to run: auto (a GPU if there is one), cuda or cpu")  # fmt: skip
    demo.add_argument(
        "--level",
        type=int,
        choices=(1, 2),
        default=2,
        help="sleep level of the RL cycle (a level-1 cycle always runs first)",
    )
    demo.add_argument("--size", choices=("tiny", "small"), default=None,
                      help="model size (default: small on a GPU, tiny on the CPU)")  # fmt: skip
    demo.add_argument("--model-family", choices=("dense", "moe"), default="dense",
                      help="dense Qwen3, or Qwen3-MoE (fused experts)")  # fmt: skip
    demo.add_argument("--png", default="dormant-demo.png", help="where to write the timeline")
    add_serve_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        try:
            check_device(args.device)
        except UsageError as error:
            print(f"dormant demo: {error}", file=sys.stderr)
            return 2
        from dormant.cli.demo import run_demo

        return run_demo(
            device=args.device,
            level=args.level,
            size=args.size,
            png=args.png,
            family=args.model_family,
        )
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
