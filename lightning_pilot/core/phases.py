"""The phase table's counters, the rule of a verdict and the aggregator that folds occurrences
into rows (docs/phase-table.md; phase and verdict names: :mod:`lightning_pilot.vocabulary`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

from lightning_pilot.vocabulary import PHASE_RANK, PHASES, worst_verdict

Counter = Literal["cuda_allocator", "accelerator_allocator", "cpu_tensor_tracker", "none"]

COUNTERS: Final[tuple[str, ...]] = get_args(Counter)


@dataclass(frozen=True)
class CheckResult:
    """One named check: ``pass``, ``warn``, ``fail`` or ``not_checked``, and why (torch-free)."""

    name: str
    verdict: str
    detail: str = ""

    def as_row(self) -> dict[str, str]:
        """The form stored in the phase table's ``checks`` column."""
        return {"name": self.name, "verdict": self.verdict, "detail": self.detail}


#: What to do when a check of the phase fails (the end of a failing row's ``reason``).
REMEDIES: Final[dict[str, str]] = {
    "data": "fix the dataset or the transform",
    "forward": "inspect the reduced batch and the values, and the modules' train mode",
    "backward": "check the graph, precision and normalisation",
    "optimizer_step": "inspect the optimizer and accumulation",
    "validation": "separate its settings from training's",
    "test": "separate its settings from training's",
    "predict": "separate its settings from training's",
    "resume": "fix the checkpoint before the series",
    "checkpoint_load": "fix the checkpoint before the series",
    "checkpoint_save": "free memory or disk before saving, or save less state",
    "export": "fix the export function before the campaign",
    "setup": "fix the model placement or precision before training",
    "overfit": "fix the loop on the tiny subset before any long run",
    "pilot": "the fit went on without this pilot check; report the error with the run folder",
}


#: The checks a phase's ``pass`` rests on (docs/phase-table.md, "Verdicts and checks"). Names
#: match the last dotted part: ``epoch_boundary.data_position`` counts as ``data_position``.
ESSENTIAL: Final[dict[str, frozenset[str]]] = {
    "overfit": frozenset({"loss_target", "targets_recovered"}),
    "resume": frozenset(
        {
            "resume",
            "rebuild",
            "weights_only_load",
            "global_step",
            "epoch",
            "lrs",
            "optimizer_state",
            "weights",
            "data_position",
            "loss_trajectory",
            "updates_after_resume",
        }
    ),
}


def judge(phase: str, checks: Iterable[tuple[str, str, str]]) -> tuple[str, str | None]:
    """The verdict of a phase from its ``(name, verdict, detail)`` checks, and the reason
    (``None`` when every check passed); docs/phase-table.md, "Verdicts and checks".

    Example:
        >>> verdict, reason = judge("forward", [("loss_finite", "fail", "loss is nan")])
        >>> verdict
        'fail'
        >>> print(reason)
        loss_finite: loss is nan. If the check fails: inspect the reduced batch and the values,
        and the modules' train mode
        >>> judge("forward", [("loss_finite", "pass", "")])
        ('pass', None)
        >>> judge("overfit", [("loss_finite", "pass", ""),
        ...                   ("loss_target", "not_checked", "capped by max_steps")])
        ('not_checked', 'not proven: loss_target (capped by max_steps)')
    """
    checks = list(checks)
    verdict = worst_verdict(v for _, v, _ in checks)
    problems = [f"{n}: {d}" if d else n for n, v, d in checks if v in ("fail", "warn")]
    unproven = [f"{n} ({d})" if d else n for n, v, d in checks if v == "not_checked"]
    if not problems:
        if not unproven:
            return verdict, None
        essential = ESSENTIAL.get(phase, frozenset())
        if any(v == "not_checked" and n.rsplit(".", 1)[-1] in essential for n, v, _ in checks):
            verdict = "not_checked"
        return verdict, "not proven: " + "; ".join(unproven)
    remedy = REMEDIES.get(phase, "")
    reason = "; ".join(problems) + (f". If the check fails: {remedy}" if remedy else "")
    if unproven:
        reason += ". Not proven: " + "; ".join(unproven)
    return verdict, reason


# Columns folded by their maximum over occurrences, and by their latest one; others keep the first.
_MAXIMA: Final = (
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "host_rss_bytes",
    "batch_size",
    "seq_len",
    "alloc_retries",
)
_LAST: Final = (
    "end_allocated_bytes",
    "device_capacity_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "buffer_bytes",
    "file_bytes",
)


@dataclass
class Occurrence:
    """One measured occurrence of a phase. ``None`` values were not measured."""

    phase: str
    step: int | None
    duration_s: float | None = None
    synchronized: bool | None = None
    values: dict[str, Any] = field(default_factory=dict)
    checks: list[CheckResult] = field(default_factory=list)
    #: False when the measurement itself slowed the occurrence down (the CPU tensor tracker).
    clean_timing: bool = True


@dataclass
class _Group:  # the occurrences folded into one row
    occurrences: int = 0
    measured: int = 0
    step_first: int | None = None
    step_last: int | None = None
    durations: list[float] = field(default_factory=list)
    clean_durations: list[float] = field(default_factory=list)
    synchronized: bool | None = None
    values: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, CheckResult] = field(default_factory=dict)

    def count(self, step: int | None, times: int = 1, step_first: int | None = None) -> None:
        self.occurrences += times
        first = step if step_first is None else step_first
        if first is not None:
            self.step_first = first if self.step_first is None else min(self.step_first, first)
        if step is not None:
            self.step_last = step if self.step_last is None else max(self.step_last, step)

    def add(self, occ: Occurrence) -> None:
        self.measured += 1
        if occ.duration_s is not None:
            self.durations.append(occ.duration_s)
            if occ.clean_timing:
                self.clean_durations.append(occ.duration_s)
        if occ.synchronized is not None:
            self.synchronized = occ.synchronized and self.synchronized is not False
        peak = occ.values.get("peak_allocated_bytes")
        best = self.values.get("peak_allocated_bytes")
        if peak is not None and (best is None or peak >= best):  # the largest peak's baseline
            self.values["baseline_allocated_bytes"] = occ.values.get("baseline_allocated_bytes")
        for column, value in occ.values.items():
            current = self.values.get(column)
            if value is None or column == "baseline_allocated_bytes":
                continue
            if column in _MAXIMA:
                self.values[column] = value if current is None else max(current, value)
            elif column in _LAST or column not in self.values:
                self.values[column] = value
        for check in occ.checks:  # the worst result of each check is kept
            previous = self.checks.setdefault(check.name, check)
            if worst_verdict([previous.verdict, check.verdict]) != previous.verdict:
                self.checks[check.name] = check

    def row(self, phase: str, first: bool) -> dict[str, Any]:
        # Median and maximum from the occurrences the measurement did not slow down, if any.
        durations = sorted(self.clean_durations or self.durations)
        checks = list(self.checks.values())
        verdict, reason = judge(phase, ((c.name, c.verdict, c.detail) for c in checks))
        if reason is None and self.measured == 0:
            reason = "not measured: outside the pilot window and the sampled updates"
        elif reason is None and verdict == "not_checked":
            skipped = [c.detail for c in checks if c.detail]
            reason = "; ".join(skipped) if skipped else "no check applies to this phase"
        row: dict[str, Any] = dict(self.values)
        row.update(
            phase=phase,
            first=first,
            occurrences=self.occurrences,
            measured_occurrences=self.measured,
            step_first=self.step_first,
            step_last=self.step_last,
            duration_s=self.durations[0] if self.durations else None,
            duration_median_s=durations[(len(durations) - 1) // 2] if durations else None,
            duration_max_s=durations[-1] if durations else None,
            synchronized=self.synchronized,
            verdict=verdict,
            checks=[c.as_row() for c in checks],
            reason=reason,
        )
        return row


class PhaseAggregator:
    """Folds occurrences of phases into phase rows: the first occurrence on its own row
    (``first=True``: the first optimizer step allocates the optimizer state), later ones into a
    second row with counts, the median and maximum duration, and the largest peak."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, bool], _Group] = {}

    def count(
        self, phase: str, step: int | None, *, times: int = 1, step_first: int | None = None
    ) -> None:
        """Count ``times`` occurrences (measured or not) up to ``step``, the first at
        ``step_first`` (default ``step``); a phase's first is counted alone."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} is invalid; expected one of {PHASES}.")
        if times < 1:
            return
        if (phase, True) not in self._groups:
            self._groups[(phase, True)] = first = _Group()
            first.count(step if times == 1 else step_first)
            times -= 1
        if times:
            self._groups.setdefault((phase, False), _Group()).count(step, times, step_first)

    def add(self, occurrence: Occurrence) -> None:
        """Add the measurements of the occurrence counted last for its phase."""
        phase = occurrence.phase
        if not (group := self._groups.get((phase, False)) or self._groups.get((phase, True))):
            raise ValueError(f"phase {phase!r} was measured before it was counted.")
        group.add(occurrence)

    def has(self, phase: str) -> bool:
        """Whether the phase occurred at least once."""
        return (phase, True) in self._groups

    def rows(self) -> list[dict[str, Any]]:
        """The phase rows, first occurrences before the rest, in phase order."""
        keys = sorted(self._groups, key=lambda k: (PHASE_RANK[k[0]], not k[1]))
        return [self._groups[k].row(k[0], k[1]) for k in keys]
