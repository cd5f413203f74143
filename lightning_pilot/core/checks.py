"""Pure checks of the training loop's phases: plain tensors and names in, named results out.

Each check returns :class:`CheckResult` objects (name, verdict, detail). A phase's verdict is
the worst of its checks (:func:`~lightning_pilot.core.phases.worst_verdict`); the remedy of the
seeds' table is added by the caller (:data:`~lightning_pilot.core.phases.REMEDIES`).

Example:
    >>> import torch
    >>> from lightning_pilot.core.checks import check_loss
    >>> [r.verdict for r in check_loss(torch.tensor(0.7))]
    ['pass', 'pass']
    >>> check_loss(torch.tensor(float("nan")))[1].detail
    'loss is nan'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CheckResult",
    "check_eval_mode",
    "check_gradients",
    "check_loss",
    "check_sample_count",
    "check_update",
    "fingerprint",
]

_MAX_NAMES = 8


@dataclass(frozen=True)
class CheckResult:
    """One named check: ``pass``, ``warn``, ``fail`` or ``not_checked``, and why."""

    name: str
    verdict: str
    detail: str = ""

    def as_row(self) -> dict[str, str]:
        """The form stored in the phase table's ``checks`` column."""
        return {"name": self.name, "verdict": self.verdict, "detail": self.detail}


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    more = len(names) - _MAX_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def check_loss(loss: Any) -> list[CheckResult]:
    """The loss is a scalar tensor and finite."""
    if not isinstance(loss, torch.Tensor):
        return [
            CheckResult("loss_scalar", "not_checked", f"loss is a {type(loss).__name__}"),
            CheckResult("loss_finite", "not_checked", "no loss tensor to check"),
        ]
    shape = CheckResult("loss_scalar", "pass", "")
    if loss.numel() != 1:
        shape = CheckResult(
            "loss_scalar",
            "fail",
            f"loss has shape {tuple(loss.shape)}; expected one value (reduce it before backward)",
        )
    value = loss.detach().float()
    if bool(torch.isfinite(value).all()):
        return [shape, CheckResult("loss_finite", "pass", "")]
    bad = "nan" if bool(torch.isnan(value).any()) else "inf"
    return [shape, CheckResult("loss_finite", "fail", f"loss is {bad}")]


def check_gradients(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    optimized: set[int],
) -> list[CheckResult]:
    """Every parameter an optimizer updates is trainable, received a gradient, and it is finite.

    Args:
        named_parameters: the module's ``named_parameters()``.
        optimized: ``id`` of every parameter in the optimizers' param groups (the ones meant to
            train).
    """
    frozen, missing, stray = [], [], []
    with_grad: list[tuple[str, torch.Tensor]] = []
    for name, param in named_parameters:
        in_optimizer = id(param) in optimized
        if in_optimizer and not param.requires_grad:
            frozen.append(name)
        elif in_optimizer and param.grad is None:
            missing.append(name)
        elif param.grad is not None:
            with_grad.append((name, param.grad))
            if not in_optimizer:
                stray.append(name)
    nonfinite: list[str] = []
    if with_grad:
        # One device synchronisation for all parameters, not one each.
        finite = torch.stack([torch.isfinite(g).all() for _, g in with_grad]).tolist()
        nonfinite = [name for (name, _), ok in zip(with_grad, finite, strict=True) if not ok]
    results = []
    if frozen:
        results.append(
            CheckResult(
                "trainable_params_require_grad",
                "fail",
                f"{len(frozen)} parameter(s) in the optimizer have requires_grad=False and cannot"
                f" learn: {_names(frozen)}",
            )
        )
    else:
        results.append(CheckResult("trainable_params_require_grad", "pass"))
    if missing:
        results.append(
            CheckResult(
                "grads_reach_params",
                "fail",
                f"{len(missing)} trainable parameter(s) received no gradient (not in the graph of"
                f" the loss, or detached): {_names(missing)}",
            )
        )
    else:
        results.append(CheckResult("grads_reach_params", "pass"))
    if nonfinite:
        results.append(
            CheckResult(
                "grads_finite",
                "fail",
                f"non-finite gradients in {len(nonfinite)} parameter(s): {_names(nonfinite)}",
            )
        )
    else:
        results.append(CheckResult("grads_finite", "pass"))
    if stray:
        results.append(
            CheckResult(
                "grads_without_optimizer",
                "warn",
                f"{len(stray)} parameter(s) receive gradients but no optimizer updates them:"
                f" {_names(stray)}",
            )
        )
    return results


def fingerprint(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
) -> dict[str, tuple[float, float]]:
    """A cheap per-parameter fingerprint (sum and L2 norm, accumulated in float64).

    Any change of a float32 element changes its value by at least one ulp, so an exact equality
    of both sums means "unchanged" except for a contrived cancellation. Computed one parameter
    at a time so the temporaries stay small, with one device synchronisation at the end.
    """
    names, sums = [], []
    for name, param in named_parameters:
        value = param.detach()
        names.append(name)
        # Reductions accumulate in float64 without a float64 copy of the parameter.
        sums.append(
            torch.stack(
                [
                    value.sum(dtype=torch.float64),
                    torch.linalg.vector_norm(value, dtype=torch.float64),
                ]
            )
        )
    if not sums:
        return {}
    table = torch.stack(sums).cpu().tolist()
    return {name: (row[0], row[1]) for name, row in zip(names, table, strict=True)}


def check_update(
    before: Mapping[str, tuple[float, float]],
    after: Mapping[str, tuple[float, float]],
    *,
    trainable: set[str],
    step_before: int,
    step_after: int,
) -> list[CheckResult]:
    """Trainable parameters changed, the others did not, and the step advanced by one."""
    unchanged = [n for n in before if n in trainable and before[n] == after.get(n)]
    moved = [n for n in before if n not in trainable and before[n] != after.get(n)]
    results = []
    if unchanged:
        results.append(
            CheckResult(
                "trainable_params_changed",
                "fail",
                f"{len(unchanged)} trainable parameter(s) did not change in the update:"
                f" {_names(unchanged)}",
            )
        )
    else:
        results.append(CheckResult("trainable_params_changed", "pass"))
    if moved:
        results.append(
            CheckResult(
                "frozen_params_unchanged",
                "fail",
                f"{len(moved)} frozen parameter(s) changed: {_names(moved)}",
            )
        )
    else:
        results.append(CheckResult("frozen_params_unchanged", "pass"))
    if step_after - step_before == 1:
        results.append(CheckResult("step_counted", "pass"))
    else:
        results.append(
            CheckResult(
                "step_counted",
                "fail",
                f"global_step went from {step_before} to {step_after} in one update; expected +1",
            )
        )
    return results


def check_eval_mode(training_modules: Sequence[str], grad_enabled: bool) -> list[CheckResult]:
    """During validation every module is in eval mode and autograd is off."""
    results = []
    if training_modules:
        results.append(
            CheckResult(
                "eval_mode",
                "fail",
                f"{len(training_modules)} module(s) in train mode during validation (dropout and"
                f" batch-norm statistics change the outputs): {_names(list(training_modules))}",
            )
        )
    else:
        results.append(CheckResult("eval_mode", "pass"))
    if grad_enabled:
        results.append(
            CheckResult(
                "no_grad",
                "fail",
                "autograd was enabled during validation (memory for activations is kept)",
            )
        )
    else:
        results.append(CheckResult("no_grad", "pass"))
    return results


def check_sample_count(seen: int, expected: int | None, why_unknown: str = "") -> CheckResult:
    """The number of samples validated equals the number expected."""
    if expected is None:
        return CheckResult("outputs_complete", "not_checked", why_unknown)
    if seen == expected:
        return CheckResult("outputs_complete", "pass", f"{seen} samples")
    return CheckResult(
        "outputs_complete",
        "fail",
        f"{seen} samples validated, expected {expected}"
        + (" (a remainder was dropped: check drop_last)" if seen < expected else ""),
    )
