"""The ``dormant`` command line; it uses public APIs only (``dormant.LLM``, ``dormant.models``)."""

from __future__ import annotations

import argparse
import sys

from dormant.cli.serve import add_serve_parser, run_serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dormant", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="an RL-style sleep/wake cycle on a small random model")
    demo.add_argument("--device", default="auto", help="auto (GPU if there is one), cuda, cpu")
    demo.add_argument(
        "--level",
        type=int,
        choices=(1, 2),
        default=2,
        help="sleep level of the RL cycle (a level-1 cycle always runs first)",
    )
    demo.add_argument(
        "--size",
        choices=("tiny", "small"),
        default=None,
        help="model size (default: small on a GPU, tiny on the CPU)",
    )
    demo.add_argument("--png", default="dormant-demo.png", help="memory timeline image")
    add_serve_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from dormant.cli.demo import run_demo

        return run_demo(device=args.device, level=args.level, size=args.size, png=args.png)
    if args.command == "serve":
        return run_serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
