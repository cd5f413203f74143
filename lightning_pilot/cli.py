"""The ``lightning-pilot`` command (also ``python -m lightning_pilot``): ``demo``, ``show``,
``compare``, ``plan``, ``sheet``, ``estimate`` and ``plot``; docs/cli.md describes each, its
scope and its exit codes."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import itertools
import math
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from lightning_pilot._version import __version__

if TYPE_CHECKING:
    import pandas as pd

    from lightning_pilot.report.load import Reads
    from lightning_pilot.storage import Location

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2

#: How many of the files skipped the one-line error names (the ``Result:`` lines name more).
_NAMED_ON_ONE_LINE = 3


class UsageError(Exception):
    """Bad input to a subcommand: printed as one line, exit code 2; when the user's own code (a
    ``FACTORY`` of ``estimate``) raised, the last frames of its traceback (``tail``) follow."""

    def __init__(self, message: str, tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tail = list(tail)


#: How many frames of the user's traceback are printed under a :class:`UsageError`.
_USER_FRAMES = 6


def _user_code_error(what: str, err: BaseException) -> UsageError:
    """``err`` raised by the user's code that ``what`` names: the frames from the first one
    past this module, ``pkgutil`` and the import machinery, the last few of them printed."""
    import pkgutil
    import traceback

    def ours(frame: traceback.FrameSummary) -> bool:
        name = frame.filename
        return name in (__file__, pkgutil.__file__) or name.startswith("<frozen ")

    frames = itertools.dropwhile(ours, traceback.extract_tb(err.__traceback__))
    theirs = [f for f in frames if not f.filename.startswith("<frozen ")]
    shown = traceback.StackSummary.from_list(theirs[-_USER_FRAMES:]).format()
    tail = [line for block in shown for line in block.rstrip("\n").split("\n")]
    if len(theirs) > _USER_FRAMES:
        tail.insert(0, f"  ... {len(theirs) - _USER_FRAMES} earlier frame(s)")
    kind, message = type(err), str(err)
    module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    said = f"{what} raised {module}{kind.__qualname__}{': ' + message if message else ''}"
    if tail:
        said += (
            " (from your code, not a lightning-pilot bug; the last frames of its traceback follow)"
        )
    return UsageError(said, tail)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2), never the usage block on stderr."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _out(text: str) -> None:
    """The one way out to the terminal: nothing a file held can drive it."""
    from lightning_pilot.report import terminal_safe

    text = terminal_safe(text, limit=None, keep_newlines=True)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _err(text: str) -> None:
    from lightning_pilot.report.units import TEXT_LIMIT, terminal_safe

    sys.stderr.write(f"lightning-pilot: {terminal_safe(text, limit=2 * TEXT_LIMIT)}\n")


def _os_error(err: OSError) -> str:
    """``Read-only file system [EROFS] (/path)``: the errno's text and name, and the path."""
    name = errno.errorcode.get(err.errno, "") if isinstance(err.errno, int) else ""
    if not err.strerror:
        return str(err)
    where = f" ({err.filename})" if err.filename else ""
    return f"{err.strerror}{f' [{name}]' if name else ''}{where}"


def _folder(text: str, argument: str, what: str) -> Location:
    """A folder argument: a local path, or a URL fsspec understands (``s3://``, ``memory://``)."""
    from lightning_pilot import storage

    try:
        path = storage.location(text)
    except (ImportError, ValueError) as err:
        raise UsageError(f"{argument} {text}: {err}") from None
    if not path.exists():
        raise UsageError(f"{path} does not exist.")
    if not path.is_dir():
        raise UsageError(f"{path} is not a folder: expected {what}.")
    return path


#: What the PATH of ``show`` and ``plot`` may be.
_SCOPE = "an output folder, a run folder (<out_dir>/runs/<run_id>) or a ledger folder"


@contextlib.contextmanager
def _usage(*kinds: type[Exception]) -> Iterator[None]:
    """Report these exceptions as a :class:`UsageError` with their message."""
    try:
        yield
    except kinds as err:
        raise UsageError(str(err)) from None


def _gate(phases: pd.DataFrame | None, runs: pd.DataFrame | None, reads: Reads) -> int:
    """Print the ``Result:`` summary; exit 1 for a failed check or a diverged/failed run, 2
    when a file in scope could not be read (what it held was not checked)."""
    from lightning_pilot.report import gate_result

    skipped = reads.skipped()
    failed, text = gate_result(phases, runs, skipped=skipped)
    _out("\n" + text)
    if failed:
        return EXIT_CHECK_FAILED
    if skipped:
        raise UsageError("not everything in scope could be read, so no clean result is claimed")
    return EXIT_OK


def _cmd_show(args: argparse.Namespace, reads: Reads) -> int:
    from lightning_pilot.report import ledger_text, phase_table_text
    from lightning_pilot.report.load import load_scope

    path = _folder(args.path, "PATH", _SCOPE)
    with _usage(ValueError):
        phases, runs, ledger_dir = load_scope(path, reads)
    if phases is not None:
        _out(f"Phase table ({len(phases)} rows) from {path}\n")
        _out(phase_table_text(phases))
    if runs is not None:
        gap = "" if phases is None else "\n"
        _out(f"{gap}Ledger ({len(runs)} run(s)) from {ledger_dir}\n")
        _out(ledger_text(runs))
    return _gate(phases, runs, reads)


def _cmd_compare(args: argparse.Namespace, reads: Reads) -> int:
    from lightning_pilot.ledger import Ledger
    from lightning_pilot.report import comparison_text, variant_costs, variant_costs_text
    from lightning_pilot.report.load import compared_runs, phases_of

    path = _folder(args.ledger, "LEDGER", "a ledger folder or an output folder holding ledger/")
    ledger = Ledger(path)
    reads.scan_folder(ledger.path)
    runs = ledger.runs()
    if runs.empty:
        raise UsageError(f"{ledger.path} holds no readable ledger records.")
    options = ("by", "control", "mode", "reduce", "failures", "experiment")
    with _usage(ValueError):
        comparison = ledger.compare(args.metric, **{name: getattr(args, name) for name in options})
    _out(f"Comparison from {ledger.path}\n")
    _out(comparison_text(comparison, by=args.by))
    if args.experiment is not None:
        runs = runs[runs["experiment"] == args.experiment]
    run_dirs = compared_runs(ledger.path.parent, runs["run_id"])
    for run in run_dirs:
        reads.scan_run(run)
    costs = variant_costs(ledger.path.parent, runs, by=args.by, control=args.control)
    _out("\nCost per variant (peak memory, time per update, data shape):\n")
    _out(variant_costs_text(costs, by=args.by))
    return _gate(phases_of(run_dirs), runs, reads)


def _cmd_plan(args: argparse.Namespace, reads: Reads) -> int:
    from lightning_pilot.core.update_plan import plan_updates
    from lightning_pilot.report import plan_text

    if args.epochs is None and args.max_steps is None:
        raise UsageError("plan needs --epochs or --max-steps.")
    with _usage(TypeError, ValueError, OverflowError):
        plan = plan_updates(
            args.dataset_size,
            args.micro_batch,
            args.accumulate,
            args.replicas,
            epochs=args.epochs,
            max_steps=args.max_steps,
            drop_last=args.drop_last,
        )
    _out(plan_text(plan))
    return EXIT_OK


def _cmd_estimate(args: argparse.Namespace, reads: Reads) -> int:
    """Estimate on target GPUs from a factory ``module:function`` returning (module, batch)."""
    import pkgutil

    from lightning_pilot.report.tables import estimate_result

    try:
        factory = pkgutil.resolve_name(args.factory)
    except Exception as err:  # the user's module runs as it is imported
        theirs = _user_code_error(f"importing FACTORY {args.factory!r}", err)
        if isinstance(err, ImportError | AttributeError | ValueError) and not theirs.tail:
            raise UsageError(f"FACTORY {args.factory!r} could not be imported: {err}") from None
        raise theirs from None
    if not callable(factory):
        raise UsageError(f"FACTORY {args.factory!r} is not callable")
    try:
        built = factory()
    except Exception as err:  # the user's exception, reported as theirs
        raise _user_code_error(f"FACTORY {args.factory!r}", err) from None
    if not isinstance(built, tuple) or len(built) != 2:
        raise UsageError(
            f"FACTORY {args.factory!r} returned {type(built).__name__}: expected a tuple"
            " (LightningModule, batch), the batch one real batch of the data"
        )
    from lightning_pilot.core.progress import LineReporter
    from lightning_pilot.estimate import estimate  # torch: only this command needs it

    classes = []
    for name in args.checkpoint_class or ():
        try:
            classes.append(pkgutil.resolve_name(name))
        except (ImportError, AttributeError, ValueError) as err:
            raise UsageError(f"--checkpoint-class {name!r} could not be imported: {err}") from None
    with _usage(TypeError, ValueError):
        result = estimate(
            built[0],
            built[1],
            targets=args.target or ["H100-SXM-80GB"],
            precisions=args.precision or ["bf16-mixed"],
            micro_batches=args.micro_batch or [1],
            seq_lens=args.seq_len or [None],
            checkpointing=_CHECKPOINTING[args.checkpointing],
            strategies=args.strategy or ["single"],
            largest=not args.no_largest,
            seq_step=args.seq_step,
            max_seq_len=args.max_seq_len,
            blocks=not args.no_blocks,
            checkpoint_classes=classes,
            capacity_factor=args.capacity_factor,
            **({} if args.timeout is None else {"timeout": args.timeout}),
            out_dir=args.out,
            progress=LineReporter("lightning-pilot estimate", min_interval_s=1.0),
        )
    failed, lines = estimate_result(result.frame(), result.largest)
    for line in [*lines, *(f"written: {path}" for path in result.paths)]:
        _out(line)
    _out(f"{len(result.rows)} row(s) in {result.seconds:.1f} s")
    return EXIT_CHECK_FAILED if failed else EXIT_OK


#: ``--checkpointing``: what :func:`~lightning_pilot.estimate.estimate` is asked for.
_CHECKPOINTING: dict[str, list[bool | str]] = {
    "off": [False],
    "on": [True],
    "both": [False, True],
    "selective": ["selective"],
    "all": [False, True, "selective"],
}


def _gpu_memory(text: str | None) -> int | None:
    from lightning_pilot.report import parse_size

    if text is None:
        return None
    with _usage(ValueError, OverflowError):
        return parse_size(text, "--gpu-memory")


def _write_sheet(
    run_dir: Location,
    reads: Reads,
    gpu_memory: int | None,
    reserve: float = 0.25,
    experiment: str | None = None,
    metric: str = "val_loss",
    control: str | None = None,
    gpu_prices: dict[str, float] | None = None,
) -> int:
    """Write and print the choice sheet; gate on the run's phase verdicts and ledger status."""
    from lightning_pilot.report import sheet
    from lightning_pilot.report.load import load_run

    reads.scan_run(run_dir)
    reads.scan_folder(run_dir.parent.parent / "ledger")
    with _usage(ValueError):
        sheet.check_options(gpu_memory, reserve)
        run = load_run(run_dir, metric=metric, experiment=experiment)
        text = sheet.render_choice_sheet(
            run,
            gpu_memory_bytes=gpu_memory,
            reserve=reserve,
            control=control,
            gpu_prices=gpu_prices,
        )
    try:
        written = sheet.publish_choice_sheet(run_dir, text)
    except OSError as err:
        raise UsageError(
            f"could not write the choice sheet to {run_dir}: {_os_error(err)}"
        ) from None
    _out(text)
    _out(f"Choice sheet written to {written}")
    runs = None if run.runs is None else run.runs[run.runs["run_id"] == run_dir.name]
    return _gate(run.phases, runs, reads)


def _cmd_sheet(args: argparse.Namespace, reads: Reads) -> int:
    gpu_memory = _gpu_memory(args.gpu_memory)
    run_dir = _folder(args.run_dir, "RUN_DIR", "a run folder, <out_dir>/runs/<run_id>")
    prices = _gpu_prices(args.gpu_price)
    return _write_sheet(
        run_dir, reads, gpu_memory, args.reserve, args.experiment, args.metric, args.control,
        prices,
    )  # fmt: skip


def _gpu_prices(given: Sequence[str] | None) -> dict[str, float]:
    """``--gpu-price TARGET=PRICE`` options as a dict (a price of one GPU-hour, > 0)."""
    prices: dict[str, float] = {}
    for text in given or ():
        name, _, value = text.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = math.nan
        if not name or not math.isfinite(price) or price <= 0:
            raise UsageError(
                f"--gpu-price {text!r} is invalid: expected TARGET=PRICE with a price > 0 per"
                " GPU-hour, such as H100-SXM-80GB=2.49"
            )
        prices[name] = price
    return prices


def _cmd_plot(args: argparse.Namespace, reads: Reads) -> int:
    from lightning_pilot.report import plots

    with _usage(ModuleNotFoundError):
        plots.require_matplotlib()
    path = _folder(args.path, "PATH", _SCOPE)
    out_dir, run_dirs = plots.scope(path)
    for run in run_dirs:
        reads.scan_run(run)
    reads.scan_folder(out_dir / "ledger")
    try:
        drawn = plots.plot_folder(
            path, metric=args.metric, control=args.control, experiment=args.experiment
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    except OSError as err:
        raise UsageError(f"could not write the plots under {path}: {_os_error(err)}") from None
    for done in drawn:
        _out(f"Plots in {done.folder}:")
        for file in done.written:
            _out(f"  {file.name}")
        for name, why in done.skipped.items():
            _out(f"  {name}: not drawn: {why}")
    written = sum(len(done.written) for done in drawn)
    _out(f"{written} plot(s) written; `lightning-pilot sheet RUN_DIR` links those of its run.")
    if reads.skipped():
        raise UsageError("not everything in scope could be read: the plots leave it out")
    return EXIT_OK


def _writable_folder(folder: Path) -> None:
    """Create ``folder`` and prove a file can be published there, before any work."""
    from lightning_pilot import storage

    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} is not a folder.")
    try:
        storage.make_folder(folder)
        probe = storage.publish_bytes(b"", folder / f"write-check-{uuid.uuid4().hex}.tmp")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"cannot write to --out {folder}: {_os_error(err)}") from None


def _cmd_demo(args: argparse.Namespace, reads: Reads) -> int:
    gpu_memory = _gpu_memory(args.gpu_memory)
    out = Path(args.out)
    _writable_folder(out)  # a read-only mount or a full disk is said before minutes of training
    # Imported here: the demo pulls in Lightning and torch, which the other commands never need.
    demo = importlib.import_module("lightning_pilot.demo.pilot")
    result: dict[str, Any] = demo.run_demo(out, quick=args.quick)
    _out(f"Demo outputs in {result['out_dir']}")
    # The gate covers the pilot run only: the comparison's lr=5 run diverges on purpose.
    with reads.capture():
        return _write_sheet(
            Path(result["pilot_run_dir"]),
            reads,
            gpu_memory,
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
    sheet.add_argument(
        "--gpu-price",
        action="append",
        metavar="TARGET=PRICE",
        help="price of one GPU-hour on an estimated target, to price the package on the target"
        " in money (repeatable)",
    )
    sheet.set_defaults(handler=_cmd_sheet)

    est = sub.add_parser(
        "estimate",
        help="estimate memory per GPU and step time on target GPUs, on fake tensors",
        description="FACTORY: 'package.module:function' returning (LightningModule, batch), the"
        " batch one real batch of the data. Runs the module's own training_step,"
        " configure_optimizers and validation_step on fake tensors (no memory is allocated)."
        " Exits 1 when a configuration could not be estimated (its reason is printed).",
    )
    est.add_argument("factory", metavar="FACTORY")
    est.add_argument("--target", action="append", metavar="NAME", help="repeatable")
    est.add_argument(
        "--precision", action="append", help="32-true, 16-mixed, bf16-mixed, bf16-true"
    )
    est.add_argument("--micro-batch", action="append", type=int, metavar="B")
    est.add_argument("--seq-len", action="append", type=int, metavar="T")
    est.add_argument(
        "--checkpointing",
        choices=tuple(_CHECKPOINTING),
        default="off",
        help="activation checkpointing: off, on (every block), both (off and on), selective"
        " (per operator), all (off, on and selective)",
    )
    est.add_argument(
        "--checkpoint-class",
        action="append",
        metavar="CLASS",
        help="'package.module:Class' of the blocks activation checkpointing wraps (repeatable;"
        " a Hugging Face model switches it on itself)",
    )
    est.add_argument("--strategy", action="append", help="single, ddp:N, fsdp:N")
    est.add_argument(
        "--no-largest", action="store_true", help="skip the largest micro-batch and seq search"
    )
    est.add_argument(
        "--seq-step", type=int, default=512, metavar="T", help="the sequence search's step"
    )
    est.add_argument(
        "--max-seq-len",
        type=int,
        default=131072,
        metavar="T",
        help="the sequence search's bound when the model declares none",
    )
    est.add_argument(
        "--no-blocks",
        action="store_true",
        help="trace every repeated block instead of three and rebuilding the rest",
    )
    est.add_argument(
        "--capacity-factor",
        type=float,
        default=1.0,
        metavar="F",
        help="a mixture of experts' busiest expert gets F times its share of the tokens"
        " (default 1: balanced routing; at least 1)",
    )
    est.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="stop the worker processes after SECONDS together (default 3600)",
    )
    est.add_argument("--out", metavar="DIR", help="write estimate.parquet and its largest table")
    est.set_defaults(handler=_cmd_estimate)

    plot = sub.add_parser(
        "plot",
        help="draw the plots of a pilot folder as PNG files next to each run's choice sheet",
        description="PATH: an output folder (every run), a run folder (<out_dir>/runs/<run_id>)"
        " or a ledger folder. Writes loss_curves.png, phase_memory.png and comparison.png into"
        " each run folder (replacing older ones); needs matplotlib (pip install"
        " 'lightning-pilot[plots]'). Exits 0 when the plots are written.",
    )
    plot.add_argument("path", metavar="PATH")
    plot.add_argument("--metric", default="val_loss", help="the metric compared across variants")
    plot.add_argument("--control", metavar="VARIANT", help="the control variant, marked")
    plot.add_argument(
        "--experiment",
        metavar="NAME",
        help="ledger experiment drawn in the loss curves and the comparison (default: each"
        " run's own)",
    )
    plot.set_defaults(handler=_cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return the exit code (docs/cli.md says which)."""
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
    handler: Callable[[argparse.Namespace, Reads], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_OK
    from lightning_pilot.report.load import Reads  # pandas, for every command but --version
    from lightning_pilot.report.units import TEXT_LIMIT, terminal_safe

    reads = Reads()
    error = None
    tail: list[str] = []
    # Readers' warnings are collected; the demo trains, Lightning's warnings shown as they come.
    capture = reads.capture() if args.command != "demo" else contextlib.nullcontext()
    try:
        with capture:
            code = handler(args, reads)
    except UsageError as err:
        error = str(err)
        tail = err.tail
    except OSError as err:
        error = _os_error(err)
    except Exception as err:  # a bug: still one line, never a traceback
        error = f"unexpected error (please report it): {type(err).__name__}: {err}"
    skipped, notes = reads.skipped(), reads.notes()
    if error is None:
        for message in [*(f"skipped {item}" for item in skipped), *notes]:
            _err(f"warning: {message}")
        return code
    extra = []  # one line: the error, then what was skipped
    if skipped:
        named = "; ".join(skipped[:_NAMED_ON_ONE_LINE])
        more = len(skipped) - _NAMED_ON_ONE_LINE
        extra.append(
            f"{len(skipped)} file(s) skipped (unreadable): {named}"
            + (f"; and {more} more" if more > 0 else "")
        )
    extra += [f"note: {note}" for note in notes]
    _err(error + (f" [{'; '.join(extra)}]" if extra else ""))
    for line in tail:  # the user's frames, each line made safe as every other line is
        sys.stderr.write(terminal_safe(line, limit=TEXT_LIMIT) + "\n")
    return EXIT_USAGE
