"""The ``lightning-pilot`` command (also ``python -m lightning_pilot``).

Subcommands:

* ``demo [--out DIR] [--quick]``: run the bundled pilot and write its choice sheet.
* ``show PATH``: the phase table with verdicts and the ledger summary.
* ``compare LEDGER --metric M [--by variant] [--control NAME]``: variants across seeds.
* ``plan --dataset-size N --micro-batch B --accumulate K [--replicas R] [--epochs E |
  --max-steps S]``: the updates and examples a configuration will make.
* ``sheet RUN_DIR [--gpu-memory 80GiB]``: the choice sheet, written to ``RUN_DIR/sheet.md``.

Exit codes (``show``, ``compare`` and ``sheet`` are a CI gate):

* 0: no check failed and no run in scope diverged or failed.
* 1: a phase verdict ``fail``, or a ledger run in scope with status ``diverged``, ``oom`` or
  ``failed`` (:data:`lightning_pilot.report.GATE_STATUSES`). The last lines printed,
  ``Result: ...``, name each such run: run id, variant, and its failed checks or its status and
  stop cause.
* 2: bad usage, or a path that is missing, not what the command expects, or unreadable (one
  line on stderr, not a traceback).

The runs in scope are those the command reports on: for ``show``, the runs of the phase tables
and of the ledger summary it prints (a run folder: that run only; an output or ledger folder:
every run); for ``compare``, the runs compared (``--experiment`` narrows them), with their
phase tables beside the ledger; for ``sheet``, the sheet's own run (the other variants of its
experiment, priced in the campaign package, are context: a diverged one is never packaged;
gate on them with ``compare``). ``plan`` exits 0 unless its input is unusable. ``demo`` is a
demonstration: its learning-rate comparison diverges one run on purpose and still exits 0
(``show`` or ``compare`` on the demo's folder exit 1 because of that run); it exits 1 only when
its own pilot run fails, which would be a bug.

Example:
    >>> from lightning_pilot.cli import main
    >>> main(["--version"])
    lightning-pilot 0.1.0
    0
    >>> main(["plan", "--dataset-size", "3200", "--micro-batch", "2", "--accumulate", "8",
    ...       "--epochs", "1"])
    16 examples per update (2 x 8 x 1 replica); 200 updates; 3,200 examples; last window full
    ...
    0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_pilot._version import __version__

if TYPE_CHECKING:
    import pandas as pd

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input to a subcommand: printed as one line, exit code 2."""


def _out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _err(text: str) -> None:
    sys.stderr.write(f"lightning-pilot: {text}\n")


def _cmd_show(args: argparse.Namespace) -> int:
    from lightning_pilot.ledger import Ledger
    from lightning_pilot.report import ledger_text, phase_table_text
    from lightning_pilot.storage import read_phase_table

    path = Path(args.path)
    if not path.exists():
        raise UsageError(f"{path} does not exist.")
    run_only = (path / "phases.parquet").is_dir()
    ledger_dir: Path | None = None
    if (path / "ledger").is_dir():
        ledger_dir = path / "ledger"
    elif run_only and (path.parent.parent / "ledger").is_dir():
        ledger_dir = path.parent.parent / "ledger"
    elif path.is_dir() and not (path / "runs").is_dir() and any(path.glob("*.parquet")):
        ledger_dir = path  # the ledger folder itself
    phases = None
    try:
        phases = read_phase_table(path)
    except ValueError:
        if ledger_dir is None:
            raise UsageError(
                f"{path} holds neither a phase table (<out_dir>/runs/<run_id>/phases.parquet)"
                " nor a ledger (<out_dir>/ledger)."
            ) from None
    runs = None
    if phases is not None:
        if phases.empty:
            raise UsageError(f"{path}: the phase table has no readable rows (corrupt files?).")
        _out(f"Phase table ({len(phases)} rows) from {path}\n")
        _out(phase_table_text(phases))
    if ledger_dir is not None:
        runs = Ledger(ledger_dir).runs()
        if run_only:
            runs = runs[runs["run_id"] == path.name]
        if phases is not None:
            _out("")
        _out(f"Ledger ({len(runs)} run(s)) from {ledger_dir}\n")
        _out(ledger_text(runs))
    # In scope: the runs shown, in the phase tables and the ledger summary.
    return _gate(phases, runs)


def _gate(phases: pd.DataFrame | None, runs: pd.DataFrame | None) -> int:
    """Print the ``Result:`` summary; exit 1 for a failed check or a diverged/failed run."""
    from lightning_pilot.report import gate_result

    failed, text = gate_result(phases, runs)
    _out("\n" + text)
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def _cmd_compare(args: argparse.Namespace) -> int:
    from lightning_pilot.ledger import Ledger
    from lightning_pilot.report import comparison_text, variant_costs, variant_costs_text

    path = Path(args.ledger)
    if not path.exists():
        raise UsageError(f"{path} does not exist.")
    ledger = Ledger(path)
    if ledger.runs().empty:
        raise UsageError(f"{ledger.path} holds no readable ledger records.")
    try:
        comparison = ledger.compare(
            args.metric,
            by=args.by,
            control=args.control,
            mode=args.mode,
            reduce=args.reduce,
            failures=args.failures,
            experiment=args.experiment,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    _out(f"Comparison from {ledger.path}\n")
    _out(comparison_text(comparison, by=args.by))
    # What each variant costs, from the phase tables beside the ledger (MISSION section 4).
    runs = ledger.runs()
    if args.experiment is not None:
        runs = runs[runs["experiment"] == args.experiment]
    costs = variant_costs(ledger.path.parent, runs, by=args.by, control=args.control)
    _out("\nCost per variant (peak memory, time per update, data shape):\n")
    _out(variant_costs_text(costs, by=args.by))
    # In scope: the runs compared, and their phase tables beside the ledger.
    return _gate(_phases_of(ledger.path.parent, runs["run_id"]), runs)


def _phases_of(out_dir: Path, run_ids: pd.Series) -> pd.DataFrame | None:
    """The phase rows of these runs under ``out_dir/runs`` (``None`` when there are none)."""
    from lightning_pilot.storage import read_phase_table

    if not (out_dir / "runs").is_dir():
        return None
    try:
        phases = read_phase_table(out_dir)
    except ValueError:
        return None
    mine: pd.DataFrame = phases[phases["run_id"].isin(set(run_ids))]
    return mine if len(mine) else None


def _cmd_plan(args: argparse.Namespace) -> int:
    from lightning_pilot.core.accounting import plan_updates
    from lightning_pilot.report import plan_text

    if args.epochs is None and args.max_steps is None:
        raise UsageError("plan needs --epochs or --max-steps.")
    try:
        plan = plan_updates(
            args.dataset_size,
            args.micro_batch,
            args.accumulate,
            args.replicas,
            epochs=args.epochs,
            max_steps=args.max_steps,
            drop_last=args.drop_last,
        )
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None
    _out(plan_text(plan))
    return EXIT_OK


def _gpu_memory(text: str | None) -> int | None:
    from lightning_pilot.report import parse_size

    if text is None:
        return None
    try:
        return parse_size(text, "--gpu-memory")
    except ValueError as err:
        raise UsageError(str(err)) from None


def _write_sheet(
    run_dir: Path,
    gpu_memory: int | None,
    reserve: float = 0.25,
    experiment: str | None = None,
    metric: str = "val_loss",
    control: str | None = None,
) -> int:
    from lightning_pilot.ledger import Ledger
    from lightning_pilot.report import write_choice_sheet
    from lightning_pilot.storage import read_phase_table

    written = write_choice_sheet(
        run_dir,
        gpu_memory_bytes=gpu_memory,
        reserve=reserve,
        experiment=experiment,
        metric=metric,
        control=control,
    )
    _out(written.read_text(encoding="utf-8"))
    _out(f"Choice sheet written to {written}")
    # In scope: the sheet's own run, its phase verdicts and its ledger status.
    phases: pd.DataFrame = read_phase_table(run_dir)
    runs = None
    ledger_dir = run_dir.parent.parent / "ledger"
    if ledger_dir.is_dir():
        runs = Ledger(ledger_dir).runs()
        runs = runs[runs["run_id"] == run_dir.name]
    return _gate(phases, runs)


def _cmd_sheet(args: argparse.Namespace) -> int:
    gpu_memory = _gpu_memory(args.gpu_memory)
    run_dir = Path(args.run_dir)
    if not run_dir.exists():
        raise UsageError(f"{run_dir} does not exist.")
    try:
        return _write_sheet(
            run_dir, gpu_memory, args.reserve, args.experiment, args.metric, args.control
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def _cmd_demo(args: argparse.Namespace) -> int:
    gpu_memory = _gpu_memory(args.gpu_memory)
    # Imported here: the demo pulls in Lightning and torch, which the other commands never need.
    demo = importlib.import_module("lightning_pilot.demo.pilot")
    result: dict[str, Any] = demo.run_demo(Path(args.out), quick=args.quick)
    _out(f"Demo outputs in {result['out_dir']}")
    # The package of the learning-rate comparison the demo just ran, priced at the pilot's speed.
    # The gate covers the pilot run only: the comparison's lr=5 run diverges on purpose (it is
    # what the demo shows), so the demo exits 0; `show` on its folder exits 1 for that run.
    return _write_sheet(
        Path(result["pilot_run_dir"]),
        gpu_memory,
        experiment=result.get("experiment"),
        control=result.get("control"),
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-pilot`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="lightning-pilot",
        description=(
            "Pilot runs for PyTorch Lightning: measure every phase, prove resume, count the"
            " examples per update and keep every diverged variant before renting GPUs."
        ),
        epilog=(
            "Exit codes: 0 no failed check and no diverged or failed run in scope, 1 a check"
            " failed or a run in scope diverged or failed (named in the last lines), 2 bad usage"
            " or unreadable path."
            " Add the callbacks to your Trainer; see the README."
        ),
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="run the bundled pilot on CPU and write its choice sheet",
        description="Run the demo LM pilot with every callback, the learning-rate comparison"
        " and the plots, then write the pilot run's choice sheet.",
    )
    demo.add_argument("--out", default="lightning-pilot-demo", help="output folder")
    demo.add_argument("--quick", action="store_true", help="a reduced-size demo")
    demo.add_argument("--gpu-memory", metavar="SIZE", help="target GPU memory, e.g. 80GiB")
    demo.set_defaults(handler=_cmd_demo)

    show = sub.add_parser(
        "show",
        help="print the phase table with verdicts and the ledger summary",
        description="PATH: an output folder (all runs and the ledger), a run folder"
        " (<out_dir>/runs/<run_id>) or a ledger folder. Exits 1 when a phase verdict is fail"
        " or a run shown diverged or failed (status diverged, oom or failed).",
    )
    show.add_argument("path", metavar="PATH")
    show.set_defaults(handler=_cmd_show)

    compare = sub.add_parser(
        "compare",
        help="compare variants across seeds from a ledger",
        description="Every run is counted by status; diverged, oom and failed runs rank worst."
        " Exits 1 when a compared run diverged or failed, or its phase table holds a fail.",
    )
    compare.add_argument("ledger", metavar="LEDGER", help="ledger folder or output folder")
    compare.add_argument(
        "--metric", required=True, help="a validation metric, train_loss, or a runs() column"
    )
    compare.add_argument("--by", default="variant", help="the column naming the groups")
    compare.add_argument("--control", default=None, help="the group to pair the others with")
    compare.add_argument("--mode", choices=["min", "max"], default="min", help="better is")
    compare.add_argument("--reduce", choices=["last", "min", "max"], default="last")
    compare.add_argument("--failures", choices=["worst", "exclude"], default="worst")
    compare.add_argument("--experiment", metavar="NAME", help="only this experiment's runs")
    compare.set_defaults(handler=_cmd_compare)

    plan = sub.add_parser(
        "plan",
        help="plan updates and examples of a configuration",
        description="The effective batch, updates and examples of a configuration, computed"
        " the way Lightning trains it.",
    )
    plan.add_argument("--dataset-size", type=int, required=True, metavar="N")
    plan.add_argument("--micro-batch", type=int, required=True, metavar="B")
    plan.add_argument("--accumulate", type=int, default=1, metavar="K")
    plan.add_argument("--replicas", type=int, default=1, metavar="R")
    budget = plan.add_mutually_exclusive_group()
    budget.add_argument("--epochs", type=int, metavar="E")
    budget.add_argument("--max-steps", type=int, metavar="S")
    plan.add_argument("--drop-last", action="store_true", help="the loader drops the last batch")
    plan.set_defaults(handler=_cmd_plan)

    sheet = sub.add_parser(
        "sheet",
        help="write and print the choice sheet of a run",
        description="Writes RUN_DIR/sheet.md (sheet-2.md, ... if it exists: never overwrites)."
        " Exits 1 when a phase verdict of the run is fail or the run diverged or failed.",
    )
    sheet.add_argument("run_dir", metavar="RUN_DIR", help="<out_dir>/runs/<run_id>")
    sheet.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="target GPU memory: 80GiB, 80GB, 141G, 24000MiB (G/GiB = 1024^3, GB = 1000^3)",
    )
    sheet.add_argument(
        "--reserve",
        type=float,
        default=0.25,
        metavar="FRACTION",
        help="share of each 3/7/30-day campaign package kept for evaluation and export"
        " (default 0.25)",
    )
    sheet.add_argument(
        "--experiment",
        metavar="NAME",
        help="ledger experiment whose variants fill the campaign package (default: the run's)",
    )
    sheet.add_argument("--metric", default="val_loss", help="the agreed quality metric")
    sheet.add_argument("--control", metavar="VARIANT", help="the control variant, marked")
    sheet.set_defaults(handler=_cmd_sheet)
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
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_OK
    error = None
    # Readers' warnings (a skipped unreadable file) become "lightning-pilot: warning:" lines;
    # the demo trains, and Lightning's own warnings are shown as they happen.
    capture = args.command != "demo"
    with warnings.catch_warnings(record=True) if capture else contextlib.nullcontext() as caught:
        if capture:
            warnings.simplefilter("always")
        try:
            code = handler(args)
        except (UsageError, FileNotFoundError, NotADirectoryError, PermissionError) as err:
            code, error = EXIT_USAGE, str(err)
    for warning in caught or []:  # what was skipped first, then the one-line error
        if issubclass(warning.category, (RuntimeWarning, UserWarning)):
            message = str(warning.message).removeprefix("lightning-pilot: ")
            _err(f"warning: {message}")
    if error is not None:
        _err(error)
    return code
