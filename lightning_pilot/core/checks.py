"""Pure checks of the training loop's phases: tensors and names in, :class:`CheckResult` out.

A phase's verdict and remedy come from :func:`~lightning_pilot.core.phases.judge`; the checks
are listed in docs/phase-table.md.

Example:
    >>> import torch
    >>> from lightning_pilot.core.checks import check_loss
    >>> [r.verdict for r in check_loss(torch.tensor(0.7))]
    ['pass', 'pass']
    >>> check_loss(torch.tensor(float("nan")))[1].detail
    'loss is nan'
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

from lightning_pilot.core.phases import CheckResult as CheckResult  # re-exported

_MAX_NAMES = 8


def shown_names(names: Sequence[Any]) -> str:
    """The first eight names, then how many more."""
    shown = ", ".join(str(name) for name in names[:_MAX_NAMES])
    more = len(names) - _MAX_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def _per_parameter(
    named_tensors: Iterable[tuple[str, torch.Tensor]], reduce: Callable[[torch.Tensor], Any]
) -> list[tuple[str, Any]]:
    """``(name, reduce(tensor))`` for each tensor, read with one device synchronisation for all
    (one reduction at a time, so the temporaries stay small)."""
    names, values = [], []
    for name, tensor in named_tensors:
        names.append(name)
        values.append(reduce(tensor))
    if not values:
        return []
    return list(zip(names, torch.stack(values).cpu().tolist(), strict=True))


def _unless(name: str, failed: object, verdict: str, detail: str, ok: str = "") -> CheckResult:
    """``verdict`` with ``detail`` when ``failed`` is truthy, else ``pass`` with ``ok``."""
    return CheckResult(name, verdict, detail) if failed else CheckResult(name, "pass", ok)


def check_loss(loss: Any) -> list[CheckResult]:
    """The loss is a scalar tensor and finite."""
    if not isinstance(loss, torch.Tensor):
        return [
            CheckResult("loss_scalar", "not_checked", f"loss is a {type(loss).__name__}"),
            CheckResult("loss_finite", "not_checked", "no loss tensor to check"),
        ]
    shape = _unless(
        "loss_scalar",
        loss.numel() != 1,
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
    intended: Collection[int] | None = None,
) -> list[CheckResult]:
    """Every parameter an optimizer updates (``id`` in ``optimized``) is trainable, received a
    gradient, and it is finite; one switched off though ``intended`` (ids) is skipped."""
    frozen, switched_off, missing, stray = [], [], [], []
    with_grad: list[tuple[str, torch.Tensor]] = []
    for name, param in named_parameters:
        in_optimizer = id(param) in optimized
        if in_optimizer and not param.requires_grad:
            if intended is not None and id(param) in intended:
                switched_off.append(name)
            else:
                frozen.append(name)
        elif in_optimizer and param.grad is None:
            missing.append(name)
        elif param.grad is not None:
            with_grad.append((name, param.grad))
            if not in_optimizer:
                stray.append(name)
    finite = _per_parameter(with_grad, lambda grad: torch.isfinite(grad).all())
    nonfinite = [name for name, ok in finite if not ok]
    results = [
        _unless(
            "trainable_params_require_grad",
            frozen,
            "fail",
            f"{len(frozen)} parameter(s) in the optimizer have requires_grad=False and cannot"
            f" learn: {shown_names(frozen)}",
            f"{len(switched_off)} parameter(s) switched off for this backward (e.g. by"
            f" toggle_optimizer) were skipped: {shown_names(switched_off)}"
            if switched_off
            else "",
        ),
        _unless(
            "grads_reach_params",
            missing,
            "fail",
            f"{len(missing)} trainable parameter(s) received no gradient (not in the graph of"
            f" the loss, or detached): {shown_names(missing)}",
        ),
        _unless(
            "grads_finite",
            nonfinite,
            "fail",
            f"non-finite gradients in {len(nonfinite)} parameter(s): {shown_names(nonfinite)}",
        ),
    ]
    if stray:
        results.append(
            CheckResult(
                "grads_without_optimizer",
                "warn",
                f"{len(stray)} parameter(s) receive gradients but no optimizer updates them:"
                f" {shown_names(stray)}",
            )
        )
    return results


def fingerprint(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
) -> dict[str, tuple[float, float]]:
    """A cheap per-parameter fingerprint: sum and L2 norm, accumulated in float64 (any change
    of a float32 element changes both)."""

    def sums(param: torch.Tensor) -> torch.Tensor:
        value = param.detach()
        norm = torch.linalg.vector_norm(value, dtype=torch.float64)
        return torch.stack([value.sum(dtype=torch.float64), norm])

    return {name: (row[0], row[1]) for name, row in _per_parameter(named_parameters, sums)}


def zero_gradients(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Names of the parameters whose gradient exists and is exactly zero in every element.

    Example:
        >>> import torch
        >>> a, b = torch.zeros(3, requires_grad=True), torch.ones(3, requires_grad=True)
        >>> (a * b).sum().backward()  # a.grad = b = 1, b.grad = a = 0
        >>> sorted(zero_gradients([("a", a), ("b", b), ("c", torch.ones(1))]))
        ['b']
    """
    grads = [(name, param.grad) for name, param in named_parameters if param.grad is not None]
    nonzero = _per_parameter(
        grads, lambda grad: (grad.coalesce().values() if grad.is_sparse else grad).detach().any()
    )
    return {name for name, flag in nonzero if not flag}


def check_update(
    before: Mapping[str, tuple[float, float]],
    after: Mapping[str, tuple[float, float]],
    *,
    trainable: set[str],
    step_before: int,
    step_after: int,
    zero_grad: Collection[str] = (),
    zero_lr: Collection[str] = (),
) -> list[CheckResult]:
    """Trainable parameters changed, the others did not, and the step advanced by one;
    ``zero_lr`` and ``zero_grad`` parameters are named, never failed (docs/phase-table.md)."""
    unchanged = [n for n in before if n in trainable and before[n] == after.get(n)]
    resting = [n for n in unchanged if n in zero_lr]
    excused = [n for n in unchanged if n in zero_grad and n not in zero_lr]
    unchanged = [n for n in unchanged if n not in zero_grad and n not in zero_lr]
    moved = [n for n in before if n not in trainable and before[n] != after.get(n)]
    notes = []
    if resting:
        notes.append(
            f"{len(resting)} parameter(s) had a learning rate of 0 at this update (a warmup that"
            f" starts at 0) and were not expected to change: {shown_names(resting)}"
        )
    if excused:
        notes.append(
            f"{len(excused)} parameter(s) had a zero gradient at this update (e.g. a LoRA"
            " down-projection while its zero-initialised up-projection is still zero) and were"
            f" not expected to change: {shown_names(excused)}"
        )
    note = "; ".join(notes)
    return [
        _unless(
            "trainable_params_changed",
            unchanged,
            "fail",
            f"{len(unchanged)} trainable parameter(s) with a nonzero or missing gradient did"
            f" not change in the update: {shown_names(unchanged)}" + (f"; {note}" if note else ""),
            note,
        ),
        _unless(
            "frozen_params_unchanged",
            moved,
            "fail",
            f"{len(moved)} frozen parameter(s) changed: {shown_names(moved)}",
        ),
        _unless(
            "step_counted",
            step_after - step_before != 1,
            "fail",
            f"global_step went from {step_before} to {step_after} in one update; expected +1",
        ),
    ]


def _train_mode_kind(module: torch.nn.Module | None) -> tuple[int, str]:
    """``(tier, label)``: 0 changes the outputs in train mode, 1 is a leaf of an unknown type, 2
    does not (docs/phase-table.md, ``eval_mode``)."""
    if module is None:  # a bare name: nothing known about it
        return 1, ""
    kind = type(module).__name__
    nn = torch.nn
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return (0, kind) if module.p > 0 else (2, kind)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        # Batch statistics in training, running ones in eval (SyncBatchNorm also syncs ranks).
        return 0, kind
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return (0, kind) if module.track_running_stats else (2, kind)
    if isinstance(module, nn.RReLU):
        return (0, kind) if module.lower != module.upper else (2, kind)
    rates = [
        f"{name}={value:g}"
        for name, value in vars(module).items()
        if "drop" in name.lower() and isinstance(value, float) and value > 0
    ]
    if rates:  # MultiheadAttention(dropout=...), RNN(dropout=...), custom attention layers
        return 0, f"{kind}, {', '.join(rates)}"
    is_leaf = next(iter(module.children()), None) is None
    if is_leaf and not type(module).__module__.startswith("torch.nn.modules."):
        return 1, kind
    return 2, kind


def _labelled(entries: Sequence[tuple[str, str]]) -> list[str]:
    return [f"{name} ({label})" if label else name for name, label in entries]


def check_eval_mode(
    training_modules: Iterable[tuple[str, torch.nn.Module] | str],
    grad_enabled: bool,
    phase: str = "validation",
) -> list[CheckResult]:
    """During evaluation every module is in eval mode and autograd is off (``training_modules``:
    ``(name, module)``, or a bare name, of every module found in train mode).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)).train()
        >>> result = check_eval_mode([("model", model), *model.named_children()], False)[0]
        >>> result.verdict, result.detail.split("; ")
        ('fail', ['1 module(s) whose outputs change in train mode during validation: 1 (Dropout)',
                  '3 module(s) in train mode in all'])
    """
    tiers: list[list[tuple[str, str]]] = [[], [], []]
    for entry in training_modules:
        name, module = (entry, None) if isinstance(entry, str) else entry
        tier, label = _train_mode_kind(module)
        tiers[tier].append((name, label))
    changing, unknown, inert = tiers
    total = len(changing) + len(unknown) + len(inert)
    no_grad = f"autograd was enabled during {phase} (memory for activations is kept)"
    no_grad_result = _unless("no_grad", grad_enabled, "fail", no_grad)
    if changing or unknown:
        parts = []
        if changing:
            parts.append(
                f"{len(changing)} module(s) whose outputs change in train mode during {phase}:"
                f" {shown_names(_labelled(changing))}"
            )
        if unknown:
            parts.append(
                f"{len(unknown)} {'more ' if changing else ''}leaf module(s) of types not known"
                f" to be mode-independent: {shown_names(_labelled(unknown))}"
            )
        parts.append(f"{total} module(s) in train mode in all")
        return [CheckResult("eval_mode", "fail", "; ".join(parts)), no_grad_result]
    inert_detail = (
        f"{len(inert)} module(s) in train mode during {phase}, none of a type known to change the"
        f" outputs (containers and mode-independent layers): {shown_names(_labelled(inert))};"
        " code that branches on `self.training` still takes its training path"
    )
    return [_unless("eval_mode", inert, "warn", inert_detail), no_grad_result]


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
