"""Overhead of each pilot callback, and of all of them, against a bare Trainer on the demo LM.

For each configuration (bare, each callback alone, all of them) one fit runs in this process on
identical data and model seeds, with every hook of every pilot callback timed from inside the
run. It reports, per configuration:

* ``window``: the mean update time over the pilot window (the first ``--window`` updates)
  divided by the bare fit's;
* ``steady``: the time spent inside the callbacks' hooks after the window, as a share of the
  rest of the update time, ordinary updates only: measured within one run, so it does not
  suffer from the run-to-run noise of whole-fit wall times on a shared machine;
* ``one-off``: the seconds of updates whose hooks took more than ``--one-off-ms`` (the resume
  check in a new process, a pilot-window flush): paid once per fit, not per update;
* ``paired``: the whole-fit ratio of median update times (monitored / bare), for reference.

    python benchmarks/overhead.py --steps 300

The figures go in the README; there is no wall-clock limit in the tests.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_pilot import (
    BatchInspector,
    DivergenceLedger,
    EffectiveBatchAccountant,
    PhaseMemoryMonitor,
    ResumeVerifier,
)
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM

CONFIGS: dict[str, Callable[[], list[pl.Callback]]] = {
    "bare": lambda: [],
    "PhaseMemoryMonitor": lambda: [PhaseMemoryMonitor()],
    "BatchInspector": lambda: [BatchInspector()],
    "EffectiveBatchAccountant": lambda: [EffectiveBatchAccountant()],
    "ResumeVerifier": lambda: [ResumeVerifier(at_step=2, compare_steps=2, check_artifact=False)],
    "DivergenceLedger": lambda: [DivergenceLedger(experiment="bench", variant="v", seed=0)],
    "all": lambda: [
        PhaseMemoryMonitor(),
        BatchInspector(),
        EffectiveBatchAccountant(),
        ResumeVerifier(at_step=2, compare_steps=2, check_artifact=False),
        DivergenceLedger(experiment="bench", variant="v", seed=0),
    ],
}


class Clock(pl.Callback):
    """Wall time of every update, and the time spent in the timed callbacks during it."""

    def __init__(self) -> None:
        self.updates: list[float] = []
        self.inside: list[float] = [0.0]
        self._last: float | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        # The Clock is last in the callback list, so the pilot callbacks' batch-end hooks
        # for this update are already counted.
        now = time.perf_counter()
        if self._last is not None:
            self.updates.append(now - self._last)
            self.inside.append(0.0)
        self._last = now


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


def fit(config: str, steps: int) -> Clock:
    torch.manual_seed(0)
    clock = Clock()
    callbacks = CONFIGS[config]()
    for callback in callbacks:
        time_hooks(callback, clock)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=steps,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*callbacks, clock],
            default_root_dir=root,
        )
        data = InstructionDataModule(dataset_size=4096, batch_size=16, max_length=32, stateful=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(TinyCausalLM(max_length=32), datamodule=data)
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=3, help="pilot window, in updates")
    parser.add_argument("--one-off-ms", type=float, default=50.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bare = fit("bare", args.steps)
    bare_window = statistics.fmean(bare.updates[1 : args.window])
    bare_median = statistics.median(bare.updates[args.window :])
    print(
        f"demo LM, {args.steps} updates, torch {torch.__version__}, {args.threads} thread(s);"
        f" bare: {1 / bare_median:.1f} updates/s after the window"
    )
    print(f"{'configuration':26} {'window':>8} {'steady':>8} {'one-off':>9} {'paired':>8}")
    for config in CONFIGS:
        if config == "bare":
            continue
        clock = fit(config, args.steps)
        updates, inside = clock.updates, clock.inside[: len(clock.updates)]
        after = list(zip(updates[args.window :], inside[args.window :], strict=True))
        one_off = [(u, i) for u, i in after if i * 1000 > args.one_off_ms]
        ordinary = [(u, i) for u, i in after if i * 1000 <= args.one_off_ms]
        spent = sum(i for _, i in ordinary)
        steady = spent / (sum(u for u, _ in ordinary) - spent)
        window = statistics.fmean(updates[1 : args.window]) / bare_window
        paired = statistics.median(u for u, _ in ordinary) / bare_median
        print(
            f"{config:26} {window:>7.2f}x {100 * steady:>7.2f}% {sum(i for _, i in one_off):>8.2f}s"
            f" {paired:>7.3f}x"
        )


if __name__ == "__main__":
    main()
