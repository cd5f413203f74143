"""The ``lightning-pilot`` command (also ``python -m lightning_pilot``).

Exit codes: 0 success (all checks passed), 1 a check failed, 2 bad usage or an unreadable
path. A missing or corrupt path is reported in one line, not a traceback.

Example:
    >>> from lightning_pilot.cli import main
    >>> main(["--version"])
    lightning-pilot 0.1.0
    0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_pilot._version import __version__

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-pilot`` (subcommands register here)."""
    parser = argparse.ArgumentParser(
        prog="lightning-pilot",
        description=(
            "Pilot runs for PyTorch Lightning: measure every phase, prove resume, count the"
            " examples per update and keep every diverged variant before renting GPUs."
        ),
        epilog=(
            "Exit codes: 0 all checks passed, 1 a check failed, 2 bad usage or unreadable path."
            " Add the callbacks to your Trainer; see the README."
        ),
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 0 for --help and 2 for bad usage
        return int(exit_.code or 0)
    if args.version:
        sys.stdout.write(f"lightning-pilot {__version__}\n")
        return EXIT_OK
    parser.print_help()
    return EXIT_OK
