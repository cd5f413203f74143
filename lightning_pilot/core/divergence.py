"""Divergence rules and run outcomes, free of Lightning (docs/ledger.md)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final

import torch

from lightning_pilot.core import validate

#: Rules that make a run ``diverged``, in priority order when several fire on one update.
FATAL_CAUSES: Final = ("nonfinite_loss", "nonfinite_grad", "loss_blowup", "loss_spike_persistent")

# The ranges of the thresholds: counts (at least) and factors (greater than).
_AT_LEAST: Final = {"window": 1, "warmup": 0, "spike_patience": 1, "blowup_patience": 1}
_ABOVE: Final = {"spike_factor": 1.0, "blowup_factor": 1.0, "blowup_cap": 0.0}


@dataclass(frozen=True)
class DivergenceRules:
    """Thresholds of the divergence rules (docs/ledger.md says what each rule does).

    Example:
        >>> DivergenceRules().spike_factor, DivergenceRules(window=5).window
        (3.0, 5)
        >>> DivergenceRules(spike_factor=1.0)
        Traceback (most recent call last):
        ...
        ValueError: DivergenceRules(spike_factor=1.0) is invalid: expected a finite number > 1.
    """

    window: int = 20  # normal losses averaged into the spike reference
    warmup: int = 20  # updates before the spike rule applies (early losses fall fast)
    spike_factor: float = 3.0  # a loss at least this many times the reference is a spike
    spike_patience: int = 5  # consecutive spike updates that make a spike persistent (fatal)
    blowup_factor: float = 10.0  # a loss above this many times the initial loss is blown up
    blowup_cap: float | None = None  # absolute floor of the blow-up threshold (None: no floor)
    blowup_patience: int = 3  # consecutive blown-up updates that are fatal
    check_grad_norm: bool = True  # apply the nonfinite_grad rule to the gradient norm

    def __post_init__(self) -> None:
        owner = "DivergenceRules"
        for name, least in _AT_LEAST.items():
            value = validate.integer(owner, name, getattr(self, name), minimum=least)
            object.__setattr__(self, name, value)
        for name, above in _ABOVE.items():
            factor = getattr(self, name)
            if factor is not None or name != "blowup_cap":  # no cap: None
                factor = validate.number(owner, name, factor, minimum=above, allow_minimum=False)
            object.__setattr__(self, name, factor)
        validate.boolean(owner, "check_grad_norm", self.check_grad_norm)


@dataclass(frozen=True)
class DivergenceEvent:
    """One thing worth recording: a fatal rule firing, a spike starting or ending."""

    step: int
    event: str
    loss: float | None
    grad_norm: float | None
    reference: float | None
    threshold: float | None
    detail: str

    def as_row(self) -> dict[str, Any]:
        """The event as a table row (NaN/inf kept as they are: they are the finding)."""
        return asdict(self)


@dataclass(frozen=True)
class DivergenceDecision:
    """The answer for one update: ``fatal`` if a fatal rule fired, ``cause`` the rule."""

    step: int
    cause: str | None = None
    events: tuple[DivergenceEvent, ...] = ()

    @property
    def fatal(self) -> bool:
        """Whether a fatal rule fired on this update."""
        return self.cause is not None


class DivergenceDetector:
    """Apply :class:`DivergenceRules` (defaults when ``None``) to one loss / norm per update.

    Attributes:
        first_fatal: ``(cause, step)`` of the first fatal rule that fired, else ``None``.
        counts: how many times each event fired."""

    STATE_VERSION: Final = 1
    #: Events of one kind listed at most (all are counted in :attr:`counts`).
    MAX_EVENTS_PER_KIND: Final = 100

    def __init__(self, rules: DivergenceRules | None = None) -> None:
        checked = validate.instance("DivergenceDetector", "rules", rules, DivergenceRules)
        self.rules = checked or DivergenceRules()
        self._window: deque[float] = deque(maxlen=self.rules.window)
        self.initial_loss: float | None = None
        self.updates = 0
        self._spike_run = 0
        self._blowup_run = 0
        self.first_fatal: tuple[str, int] | None = None
        self.counts: dict[str, int] = {}

    def _event(
        self,
        events: list[DivergenceEvent],
        event: str,
        base: Mapping[str, Any],
        detail: str,
        reference: float | None = None,
        threshold: float | None = None,
    ) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1
        if self.counts[event] <= self.MAX_EVENTS_PER_KIND:  # a diverging run must not flood it
            found = DivergenceEvent(
                **base, event=event, reference=reference, threshold=threshold, detail=detail
            )
            events.append(found)

    def update(
        self,
        step: int,
        loss: float | None,
        grad_norm: float | None = None,
        *,
        grad_may_overflow: bool = False,
    ) -> DivergenceDecision:
        """Apply the rules to the update that finished at ``step`` (a ``None`` loss or norm: its
        rules skipped; ``grad_may_overflow``: a non-finite norm is a scaler's ``grad_overflow``)."""
        self.updates += 1
        events: list[DivergenceEvent] = []
        fired: list[str] = []
        base = {"step": step, "loss": loss, "grad_norm": grad_norm}
        if loss is not None and not math.isfinite(loss):
            fired.append("nonfinite_loss")
            self._event(events, "nonfinite_loss", base, f"training loss is {loss}")
        elif loss is not None:
            fired.extend(self._loss_rules(loss, events, base))
        if grad_norm is not None and not math.isfinite(grad_norm) and self.rules.check_grad_norm:
            if grad_may_overflow:
                detail = "gradient scaler overflow: the step is skipped"
                self._event(events, "grad_overflow", base, detail)
            else:
                fired.append("nonfinite_grad")
                self._event(events, "nonfinite_grad", base, f"total gradient norm is {grad_norm}")
        cause = min(fired, key=FATAL_CAUSES.index) if fired else None
        if cause is not None and self.first_fatal is None:
            self.first_fatal = (cause, step)
        return DivergenceDecision(step=step, cause=cause, events=tuple(events))

    def _loss_rules(
        self, loss: float, events: list[DivergenceEvent], base: Mapping[str, Any]
    ) -> list[str]:
        rules, fired = self.rules, []
        if self.initial_loss is None:
            self.initial_loss = loss
        limit = self.blowup_threshold
        self._blowup_run = self._blowup_run + 1 if limit is not None and loss > limit else 0
        if self._blowup_run == rules.blowup_patience:
            fired.append("loss_blowup")
            detail = f"loss above {limit:.6g} for {rules.blowup_patience} consecutive updates"
            self._event(events, "loss_blowup", base, detail, self.initial_loss, limit)
        reference = self.reference
        spike_at = None if reference is None else rules.spike_factor * reference
        if spike_at is not None and loss >= spike_at:
            self._spike_run += 1
            if self._spike_run == 1:
                self._event(events, "spike", base, "loss spike started", reference, spike_at)
            if self._spike_run == rules.spike_patience:
                fired.append("loss_spike_persistent")
                detail = (
                    f"loss >= {rules.spike_factor} x recent mean for {rules.spike_patience}"
                    " consecutive updates"
                )
                self._event(events, "loss_spike_persistent", base, detail, reference, spike_at)
            return fired  # a spike never enters the window: a loss stuck higher stays a spike
        if self._spike_run:
            detail = f"isolated spike of {self._spike_run} update(s)"
            self._event(events, "spike_end", base, detail, reference, spike_at)
            self._spike_run = 0
        self._window.append(loss)
        return fired

    @property
    def reference(self) -> float | None:
        """The mean of recent normal losses; ``None`` in the warm-up or when not positive."""
        if self.updates <= self.rules.warmup or not self._window:
            return None
        mean = sum(self._window) / len(self._window)
        return mean if mean > 0 else None

    @property
    def blowup_threshold(self) -> float | None:
        """``max(cap, factor x initial)``, ``None`` when neither is positive."""
        candidates = [self.rules.blowup_cap] if self.rules.blowup_cap is not None else []
        if self.initial_loss is not None and self.initial_loss > 0:
            candidates.append(self.rules.blowup_factor * self.initial_loss)
        return max(candidates) if candidates else None

    def state_dict(self) -> dict[str, Any]:
        """The detector's state (weights-only-safe types)."""
        return {
            "version": self.STATE_VERSION,
            "window": list(self._window),
            "initial_loss": self.initial_loss,
            "updates": self.updates,
            "spike_run": self._spike_run,
            "blowup_run": self._blowup_run,
            "first_fatal": list(self.first_fatal) if self.first_fatal else None,
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; missing keys keep their fresh defaults."""
        self._window = deque((float(v) for v in state.get("window", [])), maxlen=self.rules.window)
        initial = state.get("initial_loss")
        self.initial_loss = float(initial) if initial is not None else None
        self.updates = int(state.get("updates", 0))
        self._spike_run = int(state.get("spike_run", 0))
        self._blowup_run = int(state.get("blowup_run", 0))
        first = state.get("first_fatal")
        self.first_fatal = (str(first[0]), int(first[1])) if first else None
        self.counts = {str(k): int(v) for k, v in dict(state.get("counts", {})).items()}


def exception_outcome(exception: BaseException) -> tuple[str, str]:
    """``(status, stop_cause)`` of a fit that ended with ``exception`` (docs/ledger.md)."""
    if isinstance(exception, KeyboardInterrupt):
        return "interrupted", "keyboard_interrupt"
    # Matched by name: core/ never imports Lightning (its class subclasses SystemExit).
    if any(cls.__name__ == "SIGTERMException" for cls in type(exception).__mro__):
        return "interrupted", "sigterm"
    if isinstance(exception, torch.OutOfMemoryError):
        return "oom", "cuda_oom"
    return "failed", f"exception:{type(exception).__name__}"


def normal_outcome(
    *,
    divergence: str | None,
    early_stopping: bool,
    time_limit: bool,
    limit_reached: str | None,
    updates_done: int,
    planned_updates: int | None,
) -> tuple[str, str]:
    """``(status, stop_cause)`` of a fit that returned normally (docs/ledger.md)."""
    if divergence is not None:
        return "diverged", divergence
    if early_stopping:
        return "stopped", "early_stopping"
    if time_limit:
        return "stopped", "time_limit"
    if limit_reached is None or (planned_updates is not None and updates_done < planned_updates):
        return "stopped", "step_shortfall"
    return "completed", limit_reached


class Curves:
    """A run's curves: training loss and learning rate per update, validation points
    (:meth:`as_record` ``since=`` a :meth:`mark`: only the points added since)."""

    def __init__(self) -> None:
        self.train_loss: list[tuple[int, float | None]] = []
        self.lr: list[tuple[int, float | None]] = []
        self.val: list[tuple[int, str, float | None]] = []

    def mark(self) -> tuple[int, int, int]:
        """Where the curves end now (pass it to :meth:`as_record` later as ``since``)."""
        return len(self.train_loss), len(self.lr), len(self.val)

    def add_train(self, step: int, loss: float | None, *, lr: float | None) -> None:
        """Add the loss and learning rate of the update that finished at ``step``."""
        self.train_loss.append((step, loss))
        self.lr.append((step, lr))

    def add_val(self, step: int, name: str, value: float | None) -> None:
        """Add one validation metric measured at ``step``."""
        self.val.append((step, name, value))

    def truncate(self, step: int) -> None:
        """Drop every point after ``step``."""
        self.train_loss = [p for p in self.train_loss if p[0] <= step]
        self.lr = [p for p in self.lr if p[0] <= step]
        self.val = [p for p in self.val if p[0] <= step]

    def as_record(
        self, since: tuple[int, int, int] | None = None
    ) -> dict[str, list[dict[str, Any]]]:
        """The ledger columns ``train_loss``, ``lr_curve`` and ``val_points`` (since a mark)."""
        train_at, lr_at, val_at = since or (0, 0, 0)
        return {
            "train_loss": [{"step": s, "value": x} for s, x in self.train_loss[train_at:]],
            "lr_curve": [{"step": s, "value": x} for s, x in self.lr[lr_at:]],
            "val_points": [{"step": s, "name": n, "value": x} for s, n, x in self.val[val_at:]],
        }

    def state_dict(self) -> dict[str, Any]:
        """The curves as lists (weights-only-safe)."""
        return {
            name: [list(p) for p in getattr(self, name)] for name in ("train_loss", "lr", "val")
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (missing keys: empty curves)."""
        self.train_loss = [(int(s), v) for s, v in state.get("train_loss", [])]
        self.lr = [(int(s), v) for s, v in state.get("lr", [])]
        self.val = [(int(s), str(n), v) for s, n, v in state.get("val", [])]
