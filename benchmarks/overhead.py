"""Overhead of each pilot callback, and of all of them, against a bare Trainer on the demo LM.

Paired runs in one process: for every configuration (each callback alone, all of them, and a
bare-against-bare calibration) a bare fit and the configured fit run in two threads that take
turns update by update (a baton passed at each batch end), pinned to one CPU core. Both fits
then see the same machine at the same moments: on a shared VM, two cores, or the same core a
minute apart, differ by several per cent, more than the cost being measured. The two threads
are not timed quite alike either, so every pair runs twice with the roles swapped and the
ratio is the geometric mean of both. Same model weights, same data. Per configuration it
reports the median over ``--repeats`` (and the range) of:

* ``window``: steps per second over the pilot window (updates 2 to ``--window``: the first
  update builds the optimizer state in every configuration), as a ratio to bare;
* ``steady``: steps per second after the window (one over the median update time), as a ratio
  to bare: 1.000 is free, 0.980 is 2 % slower;
* ``hooks``: the time spent inside the callbacks' own hooks after the window, as a share of the
  rest of the update, from one more fit whose hooks are each timed by a wrapper (the paired
  fits run without it: it adds a little of its own);
* ``one-off``: seconds of updates whose hooks took longer than ``--one-off-ms`` (the resume
  check in a new process, the pilot-window flush) in that fit: paid once per fit, not per
  update.

    python benchmarks/overhead.py --steps 300 --repeats 5

The figures go in the README; there is no wall-clock limit in the tests.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import Logger
from phase_overhead import UpdateTimer  # this folder: the scripts run as benchmarks/<name>.py

from lightning_pilot import (
    BatchInspector,
    DivergenceLedger,
    EffectiveBatchAccountant,
    PhaseMemoryMonitor,
    ResumeVerifier,
)
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM

CONFIGS: dict[str, Callable[[], list[pl.Callback]]] = {
    # Bare against bare: the measurement's own bias and noise (should read 1.000).
    "bare (calibration)": lambda: [],
    "PhaseMemoryMonitor": lambda: [PhaseMemoryMonitor()],
    "BatchInspector": lambda: [BatchInspector()],
    "EffectiveBatchAccountant": lambda: [EffectiveBatchAccountant()],
    "ResumeVerifier": lambda: [ResumeVerifier(at_step=2, compare_steps=2, check_artifact=False)],
    "DivergenceLedger": lambda: [DivergenceLedger(experiment="bench", variant="v", seed=0)],
    # Five callbacks that do nothing: what Lightning's own hook dispatch costs for five.
    "5 empty callbacks": lambda: [pl.Callback() for _ in range(5)],
    # Lightning's own per-update monitor, for scale.
    "DeviceStatsMonitor(cpu_stats=True)": lambda: [DeviceStatsMonitor(cpu_stats=True)],
    "all": lambda: [
        PhaseMemoryMonitor(),
        BatchInspector(),
        EffectiveBatchAccountant(),
        ResumeVerifier(at_step=2, compare_steps=2, check_artifact=False),
        DivergenceLedger(experiment="bench", variant="v", seed=0),
    ],
}


class Clock(UpdateTimer):
    """Wall time of every update, and the time spent in the timed callbacks during it."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: list[float] = [0.0]

    def on_train_batch_end(self, *args: Any) -> None:
        # The Clock is last in the callback list, so the pilot callbacks' batch-end hooks
        # for this update are already counted.
        timed = len(self.times)
        super().on_train_batch_end(*args)
        if len(self.times) > timed:
            self.inside.append(0.0)


def time_hooks(callback: pl.Callback, clock: Clock) -> None:
    """Wrap every hook the callback's class defines so its time is added to the clock."""
    names = [n for n in dir(pl.Callback) if n.startswith("on_") or n in ("setup", "teardown")]
    for name in names:
        if getattr(type(callback), name) is getattr(pl.Callback, name):
            continue  # not overridden: Lightning's no-op
        original = getattr(callback, name)

        def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                clock.inside[-1] += time.perf_counter() - started

        setattr(callback, name, timed)


class Baton:
    """Two fits in two threads take turns update by update, so both see the same machine."""

    def __init__(self) -> None:
        self._turn = 0
        self._done = [False, False]
        self._cond = threading.Condition()

    def wait(self, me: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == me or self._done[1 - me])

    def pass_on(self, me: int, *, done: bool = False) -> None:
        with self._cond:
            self._turn = 1 - me
            self._done[me] = self._done[me] or done
            self._cond.notify_all()


class TurnClock(Clock):
    """A Clock that times one update per turn: from taking the baton to handing it back."""

    def __init__(self, baton: Baton, me: int) -> None:
        super().__init__()
        self.baton, self.me = baton, me

    def on_train_start(self, *args: Any) -> None:
        self.baton.wait(self.me)
        self._last = time.perf_counter()

    def on_train_batch_start(self, *args: Any) -> None:
        pass

    def on_train_batch_end(self, *args: Any) -> None:
        super().on_train_batch_end(*args)
        self.baton.pass_on(self.me)
        self.baton.wait(self.me)
        self._last = time.perf_counter()  # the other fit's update is not ours

    def on_train_end(self, *args: Any) -> None:
        self.baton.pass_on(self.me, done=True)

    def on_exception(self, *args: Any) -> None:
        self.baton.pass_on(self.me, done=True)


class NullLogger(Logger):
    """A logger that keeps nothing: DeviceStatsMonitor needs one; every fit gets it alike."""

    name = "null"
    version = 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


_BUILD = threading.Lock()  # the global RNG is shared by the threads: identical weights


def fit(
    config: str | None, steps: int, clock: Clock | None = None, *, timed: bool = False
) -> Clock:
    with _BUILD:
        torch.manual_seed(0)
        model = TinyCausalLM(max_length=32)
    clock = clock or Clock()
    callbacks = CONFIGS[config]() if config else []
    for callback in callbacks if timed else ():
        time_hooks(callback, clock)  # the wrapper costs a little: only for the hooks figure
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="auto",
            devices=1,
            max_steps=steps,
            limit_val_batches=0,
            logger=NullLogger(),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*callbacks, clock],
            default_root_dir=root,
        )
        data = InstructionDataModule(dataset_size=4096, batch_size=16, max_length=32, stateful=True)
        trainer.fit(model, datamodule=data)
    return clock


def paired_fits(config: str, steps: int, *, swap: bool) -> tuple[Clock, Clock]:
    """A bare fit and a fit with ``config`` in two threads, alternating update by update.

    Returns (bare, config) clocks. ``swap`` runs the bare fit in this thread and the other in
    a new one: the two threads are not timed quite alike, so every pair runs both ways.
    """
    baton = Baton()
    clocks = (TurnClock(baton, 0), TurnClock(baton, 1))
    jobs = [(None, steps, clocks[0]), (config, steps, clocks[1])]
    other = threading.Thread(target=fit, args=jobs[0 if not swap else 1])
    other.start()
    fit(*jobs[1 if not swap else 0])
    other.join()
    return clocks


def rates(clock: Clock, window: int, one_off_ms: float) -> dict[str, float]:
    """Steps per second in the window and after it; hook share and one-off seconds after it."""
    updates, inside = clock.times, clock.inside[: len(clock.times)]
    after = list(zip(updates[window:], inside[window:], strict=True))
    ordinary = [(u, i) for u, i in after if i * 1000 <= one_off_ms]
    spent = sum(i for _, i in ordinary)
    return {
        "window": 1 / statistics.fmean(updates[1:window]),
        "steady": 1 / statistics.median(u for u, _ in after),
        "hooks": spent / (sum(u for u, _ in ordinary) - spent),
        "one_off": sum(i for _, i in after if i * 1000 > one_off_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=3, help="pilot window, in updates")
    parser.add_argument("--one-off-ms", type=float, default=50.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--cpu", type=int, default=0, help="the one CPU core both fits run on (none: -1)"
    )
    parser.add_argument("--only", nargs="*", choices=list(CONFIGS), help="configurations to run")
    args = parser.parse_args()
    if args.cpu == -1:
        args.cpu = None
    if args.window < 2:
        parser.error(f"--window={args.window} is invalid: expected at least 2 updates")
    torch.set_num_threads(args.threads)
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        # Both fits on one core: two cores of a shared machine differ by several per cent.
        os.sched_setaffinity(0, {args.cpu})
    limits = (args.window, args.one_off_ms)
    configs = args.only or list(CONFIGS)
    warnings.simplefilter("ignore")  # for both threads (catch_warnings is not thread-safe)
    ratios: dict[str, dict[str, list[float]]] = {c: {} for c in configs}
    bare_steady: list[float] = []
    for repeat in range(args.repeats):
        for config in configs:
            both = []
            for swap in (False, True):
                bare_clock, clock = paired_fits(config, args.steps, swap=swap)
                both.append((rates(bare_clock, *limits), rates(clock, *limits)))
            row = ratios[config]
            for key in ("window", "steady"):
                # The geometric mean of both thread orders: the threads' own bias cancels.
                ratio = math.prod(got[key] / bare[key] for bare, got in both) ** 0.5
                row.setdefault(key, []).append(ratio)
            if repeat == 0:  # within one fit: no pairing needed, once is enough
                timed = rates(fit(config, args.steps, timed=True), *limits)
                row["hooks"], row["one_off"] = [timed["hooks"]], [timed["one_off"]]
            bare_steady.extend(bare["steady"] for bare, _ in both)
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"\ndemo LM on {device}, {args.steps} updates x {args.repeats} repeats, torch"
        f" {torch.__version__}, {args.threads} thread(s); bare: "
        f"{statistics.median(bare_steady):.1f} updates/s after the window"
    )
    print("steps/s ratios to bare (median over repeats, [min, max]); 1.000 = as fast as bare")
    print(f"{'configuration':26} {'window':>8} {'steady':>22} {'hooks':>7} {'one-off':>8}")
    for config in configs:
        row = ratios[config]
        steady = row["steady"]
        print(
            f"{config:26} {statistics.median(row['window']):>7.3f}x"
            f" {statistics.median(steady):>7.3f}x [{min(steady):.3f}, {max(steady):.3f}]"
            f" {100 * statistics.median(row['hooks']):>6.2f}%"
            f" {statistics.median(row['one_off']):>7.2f}s"
        )


if __name__ == "__main__":
    main()
