"""Entry point of the ``zerodp`` command: a dispatcher over one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` (registers its options and sets
``func``) so that adding a command never touches the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand name -> module under zerodp.apps.cli. Imported lazily so `zerodp estimate` stays fast.
SUBCOMMANDS = {
    "bench": "zerodp.apps.cli.bench",
    "consolidate": "zerodp.apps.cli.consolidate",
    "estimate": "zerodp.apps.cli.estimate",
    "train": "zerodp.apps.cli.train",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerodp", description="ZeRO data parallelism for PyTorch: train, estimate, bench."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
