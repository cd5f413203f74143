"""``python -m lightning_pilot.demo``: a pilot of the tiny LM and a learning-rate comparison.

Runs :func:`lightning_pilot.demo.pilot.run_demo`: a pilot fit with every callback, a tiny-subset
overfit, then the learning-rate comparison (control, half, double and one unstable learning
rate, 200 updates of 2 x 8 examples each) in one ledger, with PNG plots when matplotlib is
installed. Under a minute on 2 CPU cores; ``--quick`` runs a few updates per fit instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from lightning_pilot.demo.pilot import run_demo
from lightning_pilot.storage import read_phase_table


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns 0 when no phase of the pilot run failed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m lightning_pilot.demo", description=__doc__)
    parser.add_argument("--out", default="pilot_out", help="output folder (default: pilot_out)")
    parser.add_argument(
        "--quick", action="store_true", help="a few updates per fit instead of 200 (seconds)"
    )
    args = parser.parse_args(argv)
    table = read_phase_table(run_demo(Path(args.out), quick=args.quick)["pilot_run_dir"])
    return 1 if (table["verdict"] == "fail").any() else 0


if __name__ == "__main__":
    raise SystemExit(main())
