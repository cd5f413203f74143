"""The rows PhaseMemoryMonitor writes, assembled without a Trainer: the phase rows, the checks of
the setup, checkpoint and export phases, and the rows of ``model.parquet`` and
``placement.parquet`` (docs/phase-table.md)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from lightning_pilot.core.gradient_evidence import GradientEvidence, Key, merge_deferred
from lightning_pilot.core.measure_schedule import QuietCounts
from lightning_pilot.core.memory import MemoryCounter, host_memory, state_bytes
from lightning_pilot.core.phases import CheckResult, Occurrence, PhaseAggregator


class PhaseRows:
    """The phase rows of one fit in the making: occurrences folded by a
    :class:`~lightning_pilot.core.phases.PhaseAggregator`, the unmeasured updates' counts
    (:attr:`quiet`) and the checks judged over the measured updates (:attr:`evidence`). With
    ``stop_on_fail``, :meth:`add`, :meth:`defer` and :meth:`settle` return the message of a
    failed check (else ``None``)."""

    def __init__(self, *, stop_on_fail: bool = False) -> None:
        self.stop_on_fail = stop_on_fail
        self.aggregator = PhaseAggregator()
        self.quiet = QuietCounts()
        self.evidence = GradientEvidence()

    def count(self, phase: str, step: int | None) -> None:
        """One occurrence of ``phase`` at ``step``, measured or not."""
        self.aggregator.count(phase, step)

    def has(self, phase: str) -> bool:
        """Whether ``phase`` occurred already."""
        return self.aggregator.has(phase)

    def add(self, occurrence: Occurrence | None, results: Iterable[CheckResult] = ()) -> str | None:
        """Add a measured occurrence (counted before) with its checks; nothing for ``None``."""
        if occurrence is None:
            return None
        results = list(results)
        occurrence.checks.extend(results)
        self.aggregator.add(occurrence)
        failed = [r for r in results if r.verdict == "fail"]
        if not (failed and self.stop_on_fail):
            return None
        named = "; ".join(f"{r.name}: {r.detail}" for r in failed)
        return f"{occurrence.phase} failed at step {occurrence.step}: {named}"

    def defer(self, key: Key, names: Iterable[str]) -> str | None:
        """Note ``names`` for the check ``key`` of a measured occurrence (see
        :meth:`GradientEvidence.defer`)."""
        self.evidence.defer(key, names)
        return self.evidence.failure() if self.evidence.settled and self.stop_on_fail else None

    def settle(self, *, may_fail: bool) -> str | None:
        """The evidence is complete: the deferred checks join the rows from now on (and fail now
        when ``may_fail``)."""
        if self.evidence.settle() and may_fail and self.stop_on_fail:
            return self.evidence.failure()
        return None

    def fold_quiet(self) -> None:
        """Fold the unmeasured updates counted so far into the rows."""
        self.quiet.fold_into(self.aggregator)

    def rows(
        self,
        *,
        device: str = "unknown",
        precision: str | None = None,
        counter: MemoryCounter | None = None,
    ) -> list[dict[str, Any]]:
        """The phase rows now, with the deferred checks once settled, the device, precision and
        memory counter (whose note fills a row without notes)."""
        self.fold_quiet()
        deferred = self.evidence.results() if self.evidence.settled else {}
        name, note = ("none", None) if counter is None else (counter.name, counter.note)
        rows = [merge_deferred(row, deferred) for row in self.aggregator.rows()]
        for row in rows:
            row.update(device=device, precision=precision, counter=name)
            if note and not row.get("notes"):
                row["notes"] = note
        return rows


def file_bytes(path: Any) -> int | None:
    """The bytes of the file, or of the files under the folder, at ``path`` (else ``None``)."""
    try:
        target = Path(os.fspath(path))
    except TypeError:
        return None
    if target.is_file():
        return target.stat().st_size
    if target.is_dir():
        return sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    return None


def checkpoint_file(occurrence: Occurrence, path: Any) -> list[CheckResult]:
    """The ``checkpoint_file`` check of a checkpoint save or load at ``path``, its size noted
    as the occurrence's ``file_bytes``."""
    size = occurrence.values["file_bytes"] = file_bytes(path)
    if size:
        return [CheckResult("checkpoint_file", "pass", f"{size} bytes")]
    return [CheckResult("checkpoint_file", "fail", f"no file with bytes at {path}")]


def export_written(occurrence: Occurrence, path: Any, error: str | None) -> list[CheckResult]:
    """The export's ``export_written`` check (failed with ``error``; none when it wrote), the
    size at ``path`` noted as the occurrence's ``file_bytes``."""
    occurrence.values["file_bytes"] = None if path is None else file_bytes(path)
    return [CheckResult("export_written", "fail", error)] if error else []


def params_on_device(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], device: torch.device
) -> CheckResult:
    """The setup's ``params_on_device``: every parameter on ``device`` (else a warning)."""
    misplaced = [n for n, p in named_parameters if p.device != device]
    if misplaced:
        detail = f"{len(misplaced)} parameter(s) not on {device}: {misplaced[:8]}"
        return CheckResult("params_on_device", "warn", detail)
    return CheckResult("params_on_device", "pass", str(device))


def model_row(
    module: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    *,
    precision: str | None,
    device: str,
) -> dict[str, Any]:
    """The row of ``model.parquet``: class, parameters, optimizers, precision and device."""
    params = list(module.parameters())
    named = [
        f"{type(o).__name__}(lr={o.param_groups[0].get('lr')})" if o.param_groups else
        type(o).__name__
        for o in optimizers
    ]  # fmt: skip
    return {
        "model_class": f"{type(module).__module__}.{type(module).__qualname__}",
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "param_bytes": state_bytes(module).param_bytes,
        "optimizers": ", ".join(named) or None,
        "precision": precision,
        "device": device,
    }


def placement_rows(
    module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], moment: str
) -> list[dict[str, Any]]:
    """The rows of ``placement.parquet`` at ``moment``: bytes per (device, kind), host swap."""
    swap = host_memory().swap_used_bytes
    rows = state_bytes(module, optimizers).placement_rows()
    return [row | {"moment": moment, "host_swap_used_bytes": swap} for row in rows]
