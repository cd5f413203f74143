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
  ``failed`` (:data:`lightning_pilot.report.GATE_STATUSES`) or a status the ledger does not
  define. The last lines printed, ``Result: ...``, name each such run: run id, variant, and its
  failed checks or its status and stop cause.
* 2: everything else that went wrong, as one line on stderr (never a traceback): bad usage, a
  path that is missing or not what the command expects, nothing readable in scope, a file in
  scope skipped as unreadable while nothing failed in what was read (the ``Result:`` lines say
  ``N file(s) skipped (unreadable)``: a clean result is never claimed on what was not read), a
  disk that refuses a write (the path and the system's reason, ``Read-only file system
  [EROFS]``).

Whatever a file holds is printed through :func:`lightning_pilot.report.terminal_safe`: an
escape sequence or a newline in a variant name is shown, never obeyed.

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
import errno
import importlib
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from lightning_pilot._version import __version__

if TYPE_CHECKING:
    import pandas as pd

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2

#: How many of the files skipped the one-line error names (the ``Result:`` lines name more).
_NAMED_ON_ONE_LINE = 3


class UsageError(Exception):
    """Bad input to a subcommand: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2), never the usage block on stderr."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _safe(text: object, *, keep_newlines: bool = False) -> str:
    from lightning_pilot.report import terminal_safe

    return terminal_safe(text, limit=None, keep_newlines=keep_newlines)


def _out(text: str) -> None:
    # The one place output leaves for the terminal: nothing a file held can drive it.
    text = _safe(text, keep_newlines=True)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _err(text: str) -> None:
    from lightning_pilot.report import TEXT_LIMIT, terminal_safe

    # One line, always: a newline in a path or a message is shown as \n.
    sys.stderr.write(f"lightning-pilot: {terminal_safe(text, limit=2 * TEXT_LIMIT)}\n")


def _os_error(err: OSError) -> str:
    """``Read-only file system [EROFS] (/path)``: the errno's text and name, and the path."""
    name = errno.errorcode.get(err.errno, "") if isinstance(err.errno, int) else ""
    if not err.strerror:
        return str(err)
    where = f" ({err.filename})" if err.filename else ""
    return f"{err.strerror}{f' [{name}]' if name else ''}{where}"


class _Reads:
    """What one command could not read: the readers' warnings, and misplaced entries.

    The readers skip a file they cannot read with a ``RuntimeWarning`` whose message starts
    ``lightning-pilot: skipped`` (``skipped unreadable file <path>: ...``) and read the rest;
    an entry that is not a plain file (a folder named like a record, a phase table replaced by
    a file) they may pass over in silence, so it is looked for here. Both are collected, so a
    command never reports a clean result on what it did not read. A damaged ledger index is
    not counted: it costs speed only, its records are read one by one.
    """

    def __init__(self) -> None:
        self._caught: list[list[warnings.WarningMessage]] = []
        self._strays: dict[str, str] = {}  # path -> why

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the warnings raised inside (the list fills as they happen)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._caught.append(caught)
            yield

    def _messages(self) -> list[tuple[bool, str]]:
        """``(skipped_a_file, message)`` per distinct warning, in order."""
        seen: dict[str, bool] = {}
        for caught in self._caught:
            for warning in caught:
                if not issubclass(warning.category, (RuntimeWarning, UserWarning)):
                    continue
                message = str(warning.message).removeprefix("lightning-pilot: ")
                # A damaged ledger index costs speed only: its records are read one by one.
                lost = (
                    issubclass(warning.category, RuntimeWarning)
                    and message.startswith("skipped ")
                    and "ledger index" not in message.split(":", 1)[0]
                )
                seen.setdefault(message, lost)
        return [(lost, message) for message, lost in seen.items()]

    def skipped(self) -> list[str]:
        """One description per file in scope that could not be read (``unreadable file
        <path>: <why>``, ``<path>: <why>``), each file once."""
        lost = [
            message.removeprefix("skipped ") for is_lost, message in self._messages() if is_lost
        ]
        # A stray a reader also reported is named once, as the reader said it.
        strays = [
            f"{path}: {why}"
            for path, why in self._strays.items()
            if not any(path in message for message in lost)
        ]
        return strays + lost

    def notes(self) -> list[str]:
        """The other warnings (a hint where the ledger is, say)."""
        return [message for lost, message in self._messages() if not lost]

    def _stray(self, path: Path, why: str) -> None:
        self._strays.setdefault(str(path), why)

    def scan_folder(self, folder: Path) -> None:
        """Entries of a table folder named like Parquet files that are not files."""
        if not folder.is_dir():
            return
        for entry in sorted(folder.iterdir()):
            visible = not entry.name.startswith((".", "_"))
            if visible and entry.suffix == ".parquet" and not entry.is_file():
                self._stray(entry, "not a file (a Parquet file is expected here)")

    def scan_run(self, run: Path) -> None:
        """A run folder's phase table: a folder of Parquet files, never a plain file."""
        table = run / "phases.parquet"
        if table.is_dir():
            self.scan_folder(table)
        elif table.exists() or table.is_symlink():
            self._stray(table, "not a folder (a phase table is a folder of Parquet files)")


def _folder(path: Path, what: str) -> None:
    if not path.exists():
        raise UsageError(f"{path} does not exist.")
    if not path.is_dir():
        raise UsageError(f"{path} is not a folder: expected {what}.")


def _run_folders(path: Path) -> list[Path]:
    runs = path / "runs"
    if not runs.is_dir():
        return []
    return sorted(p for p in runs.iterdir() if p.is_dir() and not p.name.startswith("."))


def _cmd_show(args: argparse.Namespace, reads: _Reads) -> int:
    from lightning_pilot.ledger import Ledger
    from lightning_pilot.report import ledger_text, phase_table_text
    from lightning_pilot.storage import read_phase_table

    path = Path(args.path)
    _folder(path, "an output folder, a run folder (<out_dir>/runs/<run_id>) or a ledger folder")
    # A run folder holds phases.parquet (a folder; a plain file there is a damaged run).
    run_only = (path / "phases.parquet").exists()
    ledger_dir: Path | None = None
    if (path / "ledger").is_dir():
        ledger_dir = path / "ledger"
    elif run_only and (path.parent.parent / "ledger").is_dir():
        ledger_dir = path.parent.parent / "ledger"
    elif not run_only and not (path / "runs").is_dir() and any(path.glob("*.parquet")):
        ledger_dir = path  # the ledger folder itself
    run_dirs = [path] if run_only else _run_folders(path)
    tables = [run / "phases.parquet" for run in run_dirs if (run / "phases.parquet").exists()]
    if not tables and ledger_dir is None:
        raise UsageError(
            f"{path} holds neither a phase table (<out_dir>/runs/<run_id>/phases.parquet)"
            " nor a ledger (<out_dir>/ledger)."
        )
    for run in run_dirs:
        reads.scan_run(run)
    if ledger_dir is not None:
        reads.scan_folder(ledger_dir)
    phases = None
    if any(table.is_dir() for table in tables):
        with contextlib.suppress(ValueError):
            phases = read_phase_table(path)
        if phases is not None and phases.empty:
            phases = None  # every file was skipped: said below, never shown as a table
    runs = None
    if ledger_dir is not None:
        runs = Ledger(ledger_dir).runs()
        if run_only:
            runs = runs[runs["run_id"] == path.name]
    if phases is None and (runs is None or runs.empty):
        # Pointed at data, nothing of it read: no table to show, no result to claim.
        missing = []
        if tables:
            missing.append("the phase table has no readable rows")
        if ledger_dir is not None:
            mine = " of this run" if run_only else ""
            where = "" if ledger_dir == path else f" {ledger_dir}"
            missing.append(f"the ledger{where} has no readable record{mine}")
        raise UsageError(f"{path}: nothing to check: {'; '.join(missing)}.")
    if phases is not None:
        _out(f"Phase table ({len(phases)} rows) from {path}\n")
        _out(phase_table_text(phases))
    if ledger_dir is not None and runs is not None:
        if phases is not None:
            _out("")
        _out(f"Ledger ({len(runs)} run(s)) from {ledger_dir}\n")
        _out(ledger_text(runs))
    # In scope: the runs shown, in the phase tables and the ledger summary.
    return _gate(phases, runs, reads)


def _gate(phases: pd.DataFrame | None, runs: pd.DataFrame | None, reads: _Reads) -> int:
    """Print the ``Result:`` summary; exit 1 for a failed check or a diverged/failed run.

    A file in scope that could not be read makes a result that is not failed exit 2: what it
    held was not checked, so the command cannot say that everything passed.
    """
    from lightning_pilot.report import gate_result

    skipped = reads.skipped()
    failed, text = gate_result(phases, runs, skipped=skipped)
    _out("\n" + text)
    if failed:
        return EXIT_CHECK_FAILED
    if skipped:
        raise UsageError("not everything in scope could be read, so no clean result is claimed")
    return EXIT_OK


def _cmd_compare(args: argparse.Namespace, reads: _Reads) -> int:
    from lightning_pilot.ledger import Ledger
    from lightning_pilot.report import comparison_text, variant_costs, variant_costs_text

    path = Path(args.ledger)
    _folder(path, "a ledger folder or an output folder holding ledger/")
    ledger = Ledger(path)
    reads.scan_folder(ledger.path)
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
    out_dir = ledger.path.parent
    run_dirs = _compared_runs(out_dir, runs["run_id"])
    for run in run_dirs:
        reads.scan_run(run)
    costs = variant_costs(out_dir, runs, by=args.by, control=args.control)
    _out("\nCost per variant (peak memory, time per update, data shape):\n")
    _out(variant_costs_text(costs, by=args.by))
    # In scope: the runs compared, and their phase tables beside the ledger.
    return _gate(_phases_of(run_dirs), runs, reads)


def _compared_runs(out_dir: Path, run_ids: pd.Series) -> list[Path]:
    """The run folders under ``out_dir/runs`` of these ledger runs (ids that are run ids)."""
    from lightning_pilot.core.ids import validate_run_id

    found = []
    for run_id in dict.fromkeys(run_ids.astype(str)):
        try:
            validate_run_id(run_id, "run_id")  # a forged id never becomes a path
        except (TypeError, ValueError):
            continue
        run = out_dir / "runs" / run_id
        if run.is_dir():
            found.append(run)
    return found


def _phases_of(run_dirs: Sequence[Path]) -> pd.DataFrame | None:
    """The phase rows of these run folders (``None`` when there are none)."""
    import pandas as pd

    from lightning_pilot.storage import read_phase_table

    frames = []
    for run in run_dirs:
        if not (run / "phases.parquet").is_dir():
            continue
        with contextlib.suppress(ValueError):
            frames.append(read_phase_table(run))
    frames = [frame for frame in frames if len(frame)]
    return pd.concat(frames, ignore_index=True) if frames else None


def _cmd_plan(args: argparse.Namespace, reads: _Reads) -> int:
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
    except (TypeError, ValueError, OverflowError) as err:
        raise UsageError(str(err)) from None
    _out(plan_text(plan))
    return EXIT_OK


def _gpu_memory(text: str | None) -> int | None:
    from lightning_pilot.report import parse_size

    if text is None:
        return None
    try:
        return parse_size(text, "--gpu-memory")
    except (ValueError, OverflowError) as err:
        raise UsageError(str(err)) from None


def _write_sheet(
    run_dir: Path,
    gpu_memory: int | None,
    reads: _Reads,
    reserve: float = 0.25,
    experiment: str | None = None,
    metric: str = "val_loss",
    control: str | None = None,
) -> int:
    from lightning_pilot.ledger import Ledger
    from lightning_pilot.report import choice_sheet, publish_choice_sheet
    from lightning_pilot.storage import read_phase_table

    ledger_dir = run_dir.parent.parent / "ledger"
    reads.scan_run(run_dir)
    if ledger_dir.is_dir():
        reads.scan_folder(ledger_dir)
    try:
        text = choice_sheet(
            run_dir,
            gpu_memory_bytes=gpu_memory,
            reserve=reserve,
            experiment=experiment,
            metric=metric,
            control=control,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        written = publish_choice_sheet(run_dir, text)
    except OSError as err:
        raise UsageError(
            f"could not write the choice sheet to {run_dir}: {_os_error(err)}"
        ) from None
    _out(written.read_text(encoding="utf-8"))
    _out(f"Choice sheet written to {written}")
    # In scope: the sheet's own run, its phase verdicts and its ledger status.
    phases: pd.DataFrame = read_phase_table(run_dir)
    runs = None
    if ledger_dir.is_dir():
        runs = Ledger(ledger_dir).runs()
        runs = runs[runs["run_id"] == run_dir.name]
    return _gate(phases, runs, reads)


def _cmd_sheet(args: argparse.Namespace, reads: _Reads) -> int:
    gpu_memory = _gpu_memory(args.gpu_memory)
    run_dir = Path(args.run_dir)
    _folder(run_dir, "a run folder, <out_dir>/runs/<run_id>")
    return _write_sheet(
        run_dir, gpu_memory, reads, args.reserve, args.experiment, args.metric, args.control
    )


def _writable_folder(folder: Path) -> None:
    """Create ``folder`` and prove a file can be published there, before any work."""
    from lightning_pilot import storage

    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} is not a folder.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = storage.publish_bytes(b"", folder / f"write-check-{uuid.uuid4().hex}.tmp")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"cannot write to --out {folder}: {_os_error(err)}") from None


def _cmd_demo(args: argparse.Namespace, reads: _Reads) -> int:
    gpu_memory = _gpu_memory(args.gpu_memory)
    out = Path(args.out)
    # A read-only mount or a full disk is said now, not after minutes of training.
    _writable_folder(out)
    # Imported here: the demo pulls in Lightning and torch, which the other commands never need.
    demo = importlib.import_module("lightning_pilot.demo.pilot")
    result: dict[str, Any] = demo.run_demo(out, quick=args.quick)
    _out(f"Demo outputs in {result['out_dir']}")
    # The package of the learning-rate comparison the demo just ran, priced at the pilot's speed.
    # The gate covers the pilot run only: the comparison's lr=5 run diverges on purpose (it is
    # what the demo shows), so the demo exits 0; `show` on its folder exits 1 for that run.
    with reads.capture():
        return _write_sheet(
            Path(result["pilot_run_dir"]),
            gpu_memory,
            reads,
            experiment=result.get("experiment"),
            control=result.get("control"),
        )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lightning-pilot`` and its subcommands."""
    parser = _Parser(
        prog="lightning-pilot",
        description=(
            "Pilot runs for PyTorch Lightning: measure every phase, prove resume, count the"
            " examples per update and keep every diverged variant before renting GPUs."
        ),
        epilog=(
            "Exit codes: 0 no failed check and no diverged or failed run in scope, 1 a check"
            " failed or a run in scope diverged or failed (named in the last lines), 2 bad usage,"
            " an unreadable path or file, or a refused write (one line on stderr)."
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
    """Run the command line; returns the exit code.

    Whatever fails that is not a check result (bad usage, a missing, misplaced or unreadable
    path, a disk that refuses a write) is exit 2 with one line on stderr, never a traceback.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as err:
        _err(str(err))
        return EXIT_USAGE
    except SystemExit as exit_:  # --help and --version of argparse exit 0
        return int(exit_.code or 0)
    if args.version:
        sys.stdout.write(f"lightning-pilot {__version__}\n")
        return EXIT_OK
    handler: Callable[[argparse.Namespace, _Reads], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_OK
    reads = _Reads()
    error = None
    code = EXIT_USAGE
    # Readers' warnings (a skipped unreadable file) are collected; the demo trains, and
    # Lightning's own warnings are shown as they happen.
    capture = reads.capture() if args.command != "demo" else contextlib.nullcontext()
    try:
        with capture:
            code = handler(args, reads)
    except UsageError as err:
        error = str(err)
    except OSError as err:
        error = _os_error(err)
    except Exception as err:  # a bug: still one line, never a traceback
        error = f"unexpected error (please report it): {type(err).__name__}: {err}"
    skipped, notes = reads.skipped(), reads.notes()
    if error is None:
        for message in [*(f"skipped {item}" for item in skipped), *notes]:
            _err(f"warning: {message}")
        return code
    # One line: the error, then what was skipped (the Result lines, when printed, name all).
    extra = []
    if skipped:
        named = "; ".join(skipped[:_NAMED_ON_ONE_LINE])
        more = len(skipped) - _NAMED_ON_ONE_LINE
        extra.append(
            f"{len(skipped)} file(s) skipped (unreadable): {named}"
            + (f"; and {more} more" if more > 0 else "")
        )
    extra += [f"note: {note}" for note in notes]
    _err(error + (f" [{'; '.join(extra)}]" if extra else ""))
    return EXIT_USAGE
