"""The ``neuron-ckpt`` command: ``neuron-ckpt memory ...`` and ``neuron-ckpt plan ...``.

Each subcommand is a module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this
file only dispatches. Bad input of any kind ends in one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

PROG = "neuron-ckpt"


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        _fail(f"{self.prog}: error: {message}")


def _fail(line: str) -> None:
    print(" ".join(line.split()), file=sys.stderr)  # one line, whatever the message holds
    raise SystemExit(2)


def _subcommands():
    from .memory import plan_cli, report

    return {
        "memory": (report, "activation memory of one layer: analytic, measured, plotted"),
        "plan": (plan_cli, plan_cli.HELP),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description="Activation recomputation and memory tools.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    for name, (module, help_text) in _subcommands().items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``neuron-ckpt`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    module, _ = _subcommands()[args.command]
    try:
        return module.run(args)
    except ValueError as exc:  # invalid sizes or combinations, named by field
        _fail(f"{PROG} {args.command}: error: {exc}")
    return 2  # not reached


if __name__ == "__main__":
    sys.exit(main())
