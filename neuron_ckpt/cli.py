"""The ``neuron-ckpt`` command: ``neuron-ckpt memory ...``, ``plan ...`` and ``compare ...``.

Each subcommand is a module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this
file only dispatches. Bad input of any kind ends in one line on stderr and exit status 2: an
option argparse refuses, a ``ValueError``/``TypeError`` naming the field, a number that
overflows, a file that cannot be read or written (:data:`INPUT_ERRORS`), a missing optional
dependency.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

PROG = "neuron-ckpt"

# What bad input raises: invalid values and combinations (json.JSONDecodeError and UnicodeError
# are ValueErrors), wrong types, file-system errors, overflow, a missing optional dependency.
INPUT_ERRORS = (ValueError, TypeError, OSError, ArithmeticError, ImportError)


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]  # argparse's is NoReturn; _fail exits
        _fail(f"{self.prog}: error: {message}")


def _fail(line: str) -> None:
    print(" ".join(line.split()), file=sys.stderr)  # one line, whatever the message holds
    raise SystemExit(2)


def error_message(exc: BaseException) -> str:
    """The one-line text of an :data:`INPUT_ERRORS` exception."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, ImportError):
        return f"{exc} (an optional dependency: pip install 'neuron_ckpt[tutorial]')"
    if isinstance(exc, ArithmeticError):
        return f"a number is out of range ({type(exc).__name__}: {exc})"
    return str(exc) or type(exc).__name__


def _subcommands():
    from .memory import compare_cli, plan_cli, report

    return {
        "memory": (report, "activation memory of one layer: analytic, measured, plotted"),
        "plan": (plan_cli, plan_cli.HELP),
        "compare": (compare_cli, compare_cli.HELP),
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
    except INPUT_ERRORS as exc:  # invalid sizes or combinations named by field, files, overflow
        _fail(f"{PROG} {args.command}: error: {error_message(exc)}")
    return 2  # not reached


if __name__ == "__main__":
    sys.exit(main())
