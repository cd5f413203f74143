"""The grid: targets x precision x micro-batch x sequence length x checkpointing x strategy,
each precision traced in one :class:`Session`, in a forked worker or here, its largest sizes
searched, then the rows made.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import torch

from lightning_pilot.core import validate
from lightning_pilot.core.progress import Reporter
from lightning_pilot.estimate.batches import _sequence_length
from lightning_pilot.estimate.fits import FRAGMENTATION
from lightning_pilot.estimate.job import Ckpt, GridJob, check_arguments, checkpointing_choice
from lightning_pilot.estimate.precision import PRECISIONS
from lightning_pilot.estimate.precision_traces import (
    PrecisionTraces,
    failures_recorded,
    phase_traces,
    trace_grid,
)
from lightning_pilot.estimate.recorder import PhaseTrace
from lightning_pilot.estimate.roofline import DEFAULT_EFFICIENCY, DEFAULT_MEMORY_EFFICIENCY
from lightning_pilot.estimate.rows import Estimate, configuration_rows, largest_row, publish
from lightning_pilot.estimate.searches import BatchFound, search_largest
from lightning_pilot.estimate.session import Session, check_source
from lightning_pilot.estimate.strategies import Strategy
from lightning_pilot.estimate.targets import Target

_OWNER: Final = "estimate"
#: The arguments of :func:`estimate` that are not the grid's.
_NOT_CHECKED: Final = ("module", "batch", "factory", "out_dir", "progress")


def estimate(
    module: Any = None,
    batch: Any = None,
    *,
    factory: Callable[[], Any] | None = None,
    targets: Sequence[str | Target] = ("H100-SXM-80GB",),
    precisions: Sequence[str] = ("bf16-mixed",),
    micro_batches: Sequence[int] = (1,),
    seq_lens: Sequence[int | None] = (None,),
    checkpointing: Sequence[Ckpt] = (False,),
    strategies: Sequence[str | Strategy] = ("single",),
    checkpoint_classes: Sequence[type[torch.nn.Module]] = (),
    wrap_classes: Sequence[type[torch.nn.Module] | str] = (),
    efficiency: tuple[float, float] = DEFAULT_EFFICIENCY,
    memory_efficiency: tuple[float, float] = DEFAULT_MEMORY_EFFICIENCY,
    allow_tf32: bool = False,
    fragmentation: float = FRAGMENTATION,
    largest: bool = True,
    verify_largest: bool = True,
    max_micro_batch: int = 1024,
    seq_step: int = 512,
    max_seq_len: int = 131072,
    blocks: bool = True,
    workers: int | None = None,
    timeout: float | None = 3600.0,
    capacity_factor: float = 1.0,
    out_dir: str | Any = None,
    progress: Any = None,
) -> Estimate:
    """Estimate memory per GPU and step time of ``module`` (or ``factory()``) on ``targets``.

    ``batch`` is one real batch of the pilot's data (dicts, lists, tuples of tensors); it is
    reshaped to each micro-batch and sequence length (``None``: as it is). Precisions are
    traced in parallel, one forked process each, up to ``workers`` (default: the CPU count;
    ``1``, or CUDA already initialised in this process, traces here). Returns an
    :class:`Estimate`; with ``out_dir``, also writes ``estimate.parquet`` and
    ``estimate_largest.parquet`` there (through :mod:`lightning_pilot.storage`, never
    overwriting).

    ``checkpoint_classes``: the module classes activation checkpointing wraps (default: the
    Hugging Face models inside switch it on themselves). ``wrap_classes``: FSDP's units (classes
    or class names; default: the Hugging Face ``_no_split_modules``). ``efficiency``: the
    fraction of the roofline compute-bound operators reach, low and high; ``memory_efficiency``:
    the fraction of the bandwidth memory-bound ones reach. ``allow_tf32``: fp32 matrix products
    on TF32 tensor cores. ``fragmentation``: reserved bytes allowed above the allocator's
    segments, in ``peak_reserved_bytes`` only: ``fits`` rests on the live blocks (a ``tight``
    note says when the reserved estimate exceeds the GPU). ``largest``: search the largest
    micro-batch per target, precision and checkpointing at the longest sequence, up to
    ``max_micro_batch`` (``verify_largest``: confirmed by tracing), and the largest sequence
    length at the smallest micro-batch, a multiple of ``seq_step`` (halved until the bound
    holds 8 steps) up to the module's declared maximum
    (:func:`~lightning_pilot.estimate.searches.sequence_bound`) or ``max_seq_len``.
    ``blocks``: trace the batch's phases with the repeated block list cut and extrapolated
    (see :class:`~lightning_pilot.estimate.Session`). ``progress``: a
    :class:`lightning_pilot.core.progress.Reporter` told as each precision's traces start and
    finish (default: none). ``timeout``: seconds the worker processes may take together
    (``None``: no limit); past it they are stopped and a ``TimeoutError`` says so (each worker
    computes on one thread, so a parent's OpenMP threads cannot leave them waiting).
    ``capacity_factor``: a mixture of experts' routing, traced balanced (``1``: every expert
    gets its share of the tokens) or with the busiest expert given that many times its share
    (:class:`~lightning_pilot.estimate.Session`'s, at least 1).

    Example:
        >>> from lightning_pilot.demo import TinyCausalLM, InstructionDataModule
        >>> data = InstructionDataModule(batch_size=4, max_length=32)
        >>> data.setup("fit")
        >>> batch = next(iter(data.train_dataloader()))
        >>> result = estimate(TinyCausalLM(max_length=32), batch, targets=["L4-24GB"],
        ...                   micro_batches=[2, 4, 8], seq_lens=[32], largest=False)
        >>> frame = result.frame()
        >>> sorted(set(frame["method"]))
        ['derived', 'extrapolated', 'traced']
        >>> bool(frame["fits"].all())
        True
    """
    # Every keyword argument of the grid, as check_arguments takes them.
    arguments = {k: v for k, v in locals().items() if k not in _NOT_CHECKED}
    check_source(_OWNER, module, factory)
    if batch is None:
        raise ValueError(validate.invalid(_OWNER, "batch", batch, "one real batch of the data"))
    checked = check_arguments(_OWNER, arguments)
    validate.path(_OWNER, "out_dir", out_dir)
    if any(s is not None for s in checked["seq_lens"]) and _sequence_length(batch) is None:
        expected = (
            "[None] (the batch as it is) for a batch without token ids (an integer tensor"
            " of 2 or more dimensions, whose dimension 1 is the sequence)"
        )
        raise ValueError(validate.invalid(_OWNER, "seq_lens", list(seq_lens), expected))
    job = GridJob(module, factory, batch, **checked)
    return run_grid(job, progress=progress, out_dir=out_dir)


def run_grid(job: GridJob, *, progress: Reporter | None = None, out_dir: Any = None) -> Estimate:
    """:func:`estimate` of a checked ``job`` (nothing is checked again): the precisions
    traced, in forked workers where ``job.workers`` allows, then the rows made."""
    started = time.perf_counter()
    done: list[tuple[PrecisionTraces, list[dict[str, Any]]]] = []
    traced = job.traced
    count = min(len(traced), job.workers or os.cpu_count() or 1)
    forkable = "fork" in multiprocessing.get_all_start_methods()
    shown = progress if progress is not None else Reporter()
    total = f"{len(job.configs)} configuration(s) x {len(job.targets)} target(s)"
    with _not_logging(job.module):
        # A forked child must not touch CUDA once the parent has initialised it (a live
        # module on a GPU: its buffers' values are read): trace in this process then.
        if count > 1 and forkable and not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            shown.update(f"tracing {', '.join(traced)} in {count} processes: {total}", done=0)
            with multiprocessing.get_context("fork").Pool(count, _worker_start, (job,)) as pool:
                deadline = time.monotonic() + (job.timeout if job.timeout is not None else math.inf)
                results = pool.imap(_worker_job, traced, chunksize=1)
                for _ in traced:
                    left = deadline - time.monotonic()
                    try:
                        finished = results.next(timeout=None if math.isinf(left) else left)
                    except multiprocessing.TimeoutError:
                        raise TimeoutError(
                            f"estimate(timeout={job.timeout}): {count} worker processes traced"
                            f" {len(done)} of {len(traced)} precision(s) ({', '.join(traced)})"
                            f" in {job.timeout} s and were stopped; pass workers=1 to trace in"
                            " this process, or a larger timeout"
                        ) from None
                    done.append(finished)
                    shown.update(
                        f"{len(done)} of {len(traced)} precision(s) traced", done=len(done)
                    )
        else:
            for index, precision in enumerate(traced):
                shown.update(f"tracing {precision}: {total}", done=index)
                done.append(_precision_job(job, precision, keep_exception=True))
    rows: list[dict[str, Any]] = []
    largest_rows: list[dict[str, Any]] = []
    by_precision = {traces.precision: traces for traces, _ in done}
    for traces, found in done:
        if traces.precision in job.extra:
            continue
        largest_rows.extend(found)
        low = by_precision.get(job.fsdp_compute.get(traces.precision, ""))
        for tgt, strategy, key in itertools.product(job.targets, job.strategies, job.grid):
            rows.extend(configuration_rows(traces, tgt, strategy, key, job, low))
    result = Estimate(rows, largest_rows, time.perf_counter() - started)
    shown.close(f"{len(rows)} row(s) in {result.seconds:.1f} s", done=len(traced))
    if out_dir is not None:
        result.paths = publish(result, out_dir)
    return result


def _precision_job(
    job: GridJob, precision: str, keep_exception: bool = False
) -> tuple[PrecisionTraces, list[dict[str, Any]]]:
    """Trace one precision of ``job`` (in a forked worker, or here): its traces and its rows
    of the largest table."""
    traces = PrecisionTraces(precision)
    found: list[dict[str, Any]] = []
    searches = job.searches(precision)
    session = Session.from_job(job, precision)
    with failures_recorded(traces, session), session:
        trace_grid(session, traces, job)
        if searches:
            traces.phase = "forward"
            for tgt, ckpt, batch_found, seq_found in search_largest(session, traces, job):
                found.append(largest_row(precision, tgt, ckpt, job.longest, batch_found, seq_found))
    if traces.error is not None and searches:  # each target and checkpointing: the failure
        status, _, reason = traces.error
        failed = BatchFound(status, reason)
        for tgt, ckpt in itertools.product(job.targets, job.checkpointing):
            found.append(largest_row(precision, tgt, ckpt, job.longest, failed, None))
    if not keep_exception:
        traces.exception = None  # not every exception survives the trip between processes
    return traces, found


_WORKER_JOB: GridJob | None = None


def _worker_start(job: GridJob) -> None:
    """Each forked worker holds ``job`` and computes on one thread: a parent's libgomp thread
    pool does not exist in a forked child, whose first parallel region would wait on it."""
    global _WORKER_JOB
    _WORKER_JOB = job
    torch.set_num_threads(1)


def _worker_job(precision: str) -> tuple[PrecisionTraces, list[dict[str, Any]]]:
    assert _WORKER_JOB is not None
    return _precision_job(_WORKER_JOB, precision)


def trace_configuration(
    module: Any = None,
    batch: Any = None,
    *,
    factory: Callable[[], Any] | None = None,
    precision: str = "32-true",
    micro_batch: int = 1,
    seq_len: int | None = None,
    checkpointing: Ckpt = False,
    checkpoint_classes: Sequence[type[torch.nn.Module]] = (),
    device: str = "cpu",
    blocks: bool = True,
) -> dict[str, PhaseTrace]:
    """The six phases of one configuration, as :func:`estimate` traces them, on ``device``
    ``"cpu"`` (storages as they are, the optimizer as on CPU: comparable with
    :func:`~lightning_pilot.estimate.measure_cpu`) or ``"cuda"`` (512-byte blocks, the CUDA
    optimizer default). ``UntraceableError`` or the user's error when a phase fails.

    Example:
        >>> from lightning_pilot.demo import TinyCausalLM, InstructionDataModule
        >>> data = InstructionDataModule(batch_size=4, max_length=32)
        >>> data.setup("fit")
        >>> batch = next(iter(data.train_dataloader()))
        >>> phases = trace_configuration(TinyCausalLM(max_length=32), batch, micro_batch=4)
        >>> phases["optimizer_step"].categories["optimizer_state"] > 0
        True
    """
    owner = "trace_configuration"
    validate.choice(owner, "precision", precision, PRECISIONS)
    validate.integer(owner, "micro_batch", micro_batch, minimum=1)
    validate.integer(owner, "seq_len", seq_len, minimum=1, optional=True)
    checkpointing_choice(checkpointing, owner)
    validate.choice(owner, "device", device, ("cpu", "cuda"))
    job = GridJob(
        module,
        factory,
        batch,
        precisions=(precision,),
        micro_batches=(micro_batch,),
        seq_lens=(seq_len,),
        checkpointing=(checkpointing,),
        checkpoint_classes=tuple(checkpoint_classes),
        largest=False,
        blocks=validate.boolean(owner, "blocks", blocks),
        device=device,
    )
    traces, _ = _precision_job(job, precision, keep_exception=True)
    if traces.exception is not None:
        raise traces.exception
    key = (checkpointing, seq_len, micro_batch)
    return {name: trace for name, (trace, _) in phase_traces(traces, key).items()}


@contextlib.contextmanager
def _not_logging(module: Any) -> Iterator[None]:
    """A live LightningModule's ``self.log``/``self.log_dict`` do nothing while its steps run on
    fake values (nothing may reach a Trainer's loggers); put back after. Nothing to do
    for ``None`` (a factory builds the module) or a plain ``nn.Module``."""
    names = ("log", "log_dict")
    if not callable(getattr(type(module), "log_dict", None)):  # no LightningModule: no logging
        yield
        return
    held = {name: module.__dict__[name] for name in names if name in module.__dict__}
    module.__dict__.update(dict.fromkeys(names, _ignore))
    try:
        yield
    finally:
        for name in names:
            module.__dict__.pop(name, None)
        module.__dict__.update(held)


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None
