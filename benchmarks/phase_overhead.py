"""Overhead of PhaseMemoryMonitor against a bare Trainer on the demo LM, paired in one process.

Each repeat runs a bare fit and a monitored fit back to back (alternating which goes first) on
identical data and model seeds, and records the wall time of every update with a tiny timing
callback present in both. It reports, per repeat and overall (median of repeats):

* the pilot window: mean time per update over the monitor's first ``pilot_updates`` updates
  (fully measured: device synchronisation at phase edges, the CPU tensor tracker, checks);
* the time spent inside the monitor itself (its hooks) after the window, as a fraction of the
  rest of the update: measured within one run, so it does not suffer from run-to-run noise;
* the steady state: the updates after the window, sampled ones included at their full measured
  cost, so the figure is what a long run pays. Ordinary updates count at their median time in
  each run, which keeps a busy neighbour on a shared machine from swinging the ratio; the raw
  ratio of total times is printed too.

Ratios are monitored / bare time per update (1.00 = no overhead). Run:

    python benchmarks/phase_overhead.py --steps 400 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_pilot import PhaseMemoryMonitor
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM


class UpdateTimer(pl.Callback):
    """Wall time of every update (present in both runs, so its cost cancels)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "_after_update",
    "on_train_batch_end",
)


def instrument(monitor: PhaseMemoryMonitor) -> list[float]:
    """Time spent inside the monitor per update (its hooks and its optimizer post-hook).

    Wall time of whole fits varies by several percent from run to run on a shared CPU; the
    monitor's own time inside the same run is measured directly and varies far less.
    """
    per_update: list[float] = [0.0]
    for name in _HOOKS:
        original = getattr(monitor, name)

        def timed(*args: Any, _original: Any = original, _name: str = name) -> Any:
            started = time.perf_counter()
            try:
                return _original(*args)
            finally:
                per_update[-1] += time.perf_counter() - started
                if _name == "on_train_batch_end":
                    per_update.append(0.0)

        setattr(monitor, name, timed)
    return per_update


def run(steps: int, monitor: PhaseMemoryMonitor | None, root: str) -> list[float]:
    torch.manual_seed(0)
    timer = UpdateTimer()
    callbacks: list[pl.Callback] = [timer] + ([monitor] if monitor else [])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )
    data = InstructionDataModule(dataset_size=4096, seed=0, batch_size=16, max_length=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyCausalLM(max_length=32), datamodule=data)
    return timer.times


def steady_ratio(bare: list[float], mon: list[float], pilot: int, every: int) -> float:
    """Monitored / bare time for the updates after the pilot window, robust to machine noise.

    Each run's ordinary update costs its median update time (a noisy neighbour moves means, not
    medians); the monitor's sampled updates are added at their measured times, so their full
    extra cost counts.
    """
    after_bare, after_mon = bare[pilot:], mon[pilot:]
    sampled = [i for i in range(len(after_mon)) if every > 0 and (i + 1) % every == 0]
    ordinary = [t for i, t in enumerate(after_mon) if i not in set(sampled)]
    mon_total = statistics.median(ordinary) * len(ordinary) + sum(after_mon[i] for i in sampled)
    return mon_total / (statistics.median(after_bare) * len(after_bare))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pilot-updates", type=int, default=3)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--root", default="/tmp/lightning-pilot-bench")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # one thread: steadier timings on a shared machine
    window, steady, inside = [], [], []
    skip = 1  # the very first update pays one-off costs in both runs
    for repeat in range(args.repeats):
        monitor = PhaseMemoryMonitor(
            pilot_updates=args.pilot_updates, sample_every=args.sample_every
        )
        hook_time = instrument(monitor)
        order = [None, monitor] if repeat % 2 == 0 else [monitor, None]
        results = {}
        for choice in order:
            results["monitor" if choice else "bare"] = run(args.steps, choice, args.root)
        bare, mon = results["bare"], results["monitor"]
        w = slice(skip, args.pilot_updates)
        window.append(statistics.fmean(mon[w]) / statistics.fmean(bare[w]))
        steady.append(steady_ratio(bare, mon, args.pilot_updates, args.sample_every))
        raw = sum(mon[args.pilot_updates :]) / sum(bare[args.pilot_updates :])
        spent = sum(hook_time[args.pilot_updates : len(mon)])
        inside.append(spent / (sum(mon[args.pilot_updates :]) - spent))
        print(
            f"repeat {repeat}: bare {1 / statistics.median(bare[args.pilot_updates :]):.1f}"
            f" updates/s; pilot window x{window[-1]:.2f}; steady state x{steady[-1]:.3f}"
            f" (raw totals x{raw:.3f}); time inside the monitor after the window"
            f" {100 * inside[-1]:.2f}% of the rest of the update"
        )
    print(
        f"median over {args.repeats} repeats ({args.steps} updates, torch"
        f" {torch.__version__}, {torch.get_num_threads()} threads): pilot window"
        f" x{statistics.median(window):.2f}, steady state x{statistics.median(steady):.3f}"
        f" (spread x{min(steady):.3f} to x{max(steady):.3f}); time inside the"
        f" monitor after the window: {100 * statistics.median(inside):.2f}% of the update"
    )


if __name__ == "__main__":
    main()
