"""Pure checks of the training loop's phases: tensors and names in, :class:`CheckResult` out
(docs/phase-table.md lists them; :func:`~lightning_pilot.core.phases.judge` gives the verdict)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

from lightning_pilot.core.phases import CheckResult as CheckResult  # re-exported
from lightning_pilot.vocabulary import worst_verdict

_MAX_NAMES = 8


def shown_names(names: Sequence[Any]) -> str:
    """The first eight names, then how many more."""
    shown = ", ".join(str(name) for name in names[:_MAX_NAMES])
    more = len(names) - _MAX_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def _per_parameter(
    named_tensors: Iterable[tuple[str, torch.Tensor]], reduce: Callable[[torch.Tensor], Any]
) -> list[tuple[str, Any]]:
    """``(name, reduce(tensor))`` for each tensor, read with one device synchronisation."""
    pairs = [(name, reduce(tensor)) for name, tensor in named_tensors]
    if not pairs:
        return []
    values = torch.stack([value for _, value in pairs]).cpu().tolist()
    return [(name, value) for (name, _), value in zip(pairs, values, strict=True)]


def _judged(name: str, problem: str | None, verdict: str = "fail", passed: str = "") -> CheckResult:
    """``verdict`` with the problem when there is one, else ``pass`` (with ``passed``)."""
    return CheckResult(name, verdict, problem) if problem else CheckResult(name, "pass", passed)


def _prefixes(name: str) -> list[str]:
    """The module names holding ``name``, from the root ``""`` to ``name`` itself."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts) + 1)]


def check_loss(loss: Any) -> list[CheckResult]:
    """The loss is a scalar tensor and finite."""
    if not isinstance(loss, torch.Tensor):
        return [
            CheckResult("loss_scalar", "not_checked", f"loss is a {type(loss).__name__}"),
            CheckResult("loss_finite", "not_checked", "no loss tensor to check"),
        ]
    shape = f"loss has shape {tuple(loss.shape)}; expected one value (reduce it before backward)"
    value = loss.detach().float()
    bad = None
    if not bool(torch.isfinite(value).all()):
        bad = "loss is nan" if bool(torch.isnan(value).any()) else "loss is inf"
    return [
        _judged("loss_scalar", shape if loss.numel() != 1 else None),
        _judged("loss_finite", bad),
    ]


#: Frozen-before-the-fit parameters pass when each is *lone* in its frozen module and together they
#: hold under this share of the optimized elements, else warn (docs/phase-table.md).
FROZEN_SHARE_WARN = 0.10


def frozen_regions(names: Sequence[str], frozen: Collection[str]) -> dict[str, list[str]]:
    """``{region: [frozen parameter names]}`` in model order, a region being the largest module
    (a dotted prefix) all of whose parameters are ``frozen`` (``""``: every parameter is)."""
    total = Counter(p for name in names for p in _prefixes(name))
    cold = Counter(p for name in names if name in frozen for p in _prefixes(name))
    regions: dict[str, list[str]] = {}
    for name in names:
        if name in frozen:
            region = next(p for p in _prefixes(name) if cold[p] == total[p])
            regions.setdefault(region, []).append(name)
    return regions


def _frozen_before_fit(
    names: Sequence[str], cold: Collection[str], frozen: Sequence[str], sizes: Mapping[str, int]
) -> tuple[str, str]:
    """``pass`` for lone ``frozen`` parameters holding a small share of the optimized elements,
    else ``warn`` naming their frozen submodules (regions of ``cold``) and the share."""
    held = set(frozen)
    regions = {r: m for r, m in frozen_regions(names, cold).items() if held.intersection(m)}
    total = sum(sizes.values())
    share = sum(sizes[n] for n in frozen) / total if total else 1.0
    lone = all(len(members) == 1 for members in regions.values())
    if lone and share < FROZEN_SHARE_WARN:
        return "pass", (
            f"{len(frozen)} lone parameter(s) frozen before the fit (requires_grad=False) are in"
            f" the optimizer, which skips them: {shown_names(frozen)}"
        )
    shown = shown_names([region or "<root>" for region in regions])
    return "warn", (
        f"{len(frozen)} parameter(s) frozen before the fit (requires_grad=False, {share:.1%} of"
        f" the optimized elements) are in the optimizer, in {len(regions)} frozen"
        f" submodule(s): {shown}; torch skips them; if intended (adapter training, a frozen"
        " tower) nothing to do; otherwise set requires_grad=True before the fit"
    )


#: What explains a trainable parameter that gets a gradient in some measured updates only.
SKIPPED_SOME_STEPS = (
    "a layer skipped by LayerDrop or stochastic depth, or an expert no token was routed to, in"
    " those steps"
)


def gradient_reach(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], optimized: Collection[int]
) -> tuple[list[str], list[str]]:
    """``(reached, missing)``: the names of the optimized (``id`` in ``optimized``) parameters
    with ``requires_grad`` that have a gradient now, and those that have none."""
    reached: list[str] = []
    missing: list[str] = []
    for name, param in named_parameters:
        if id(param) in optimized and param.requires_grad:
            (missing if param.grad is None else reached).append(name)
    return reached, missing


def _over_updates(
    name: str,
    missing: Sequence[str],
    reached: Collection[str],
    fail: Callable[[list[str]], str],
    skipped: Callable[[list[str]], str],
) -> CheckResult:
    """``fail`` naming ``missing`` ones never ``reached``; ``pass`` noting those that were."""
    never = [n for n in missing if n not in reached]
    some = [n for n in missing if n in reached]
    note = skipped(some) if some else ""
    if never:
        return CheckResult(name, "fail", fail(never) + (f"; {note}" if note else ""))
    return CheckResult(name, "pass", note)


def check_reached(
    missing: Sequence[str], reached: Collection[str], backwards: int = 1
) -> CheckResult:
    """``grads_reach_params`` over ``backwards`` measured backwards: a parameter without a
    gradient in one (``missing``) fails unless it got one in another (``reached``): then it
    passes, named (docs/phase-table.md, "Missing gradients")."""
    return _over_updates(
        "grads_reach_params",
        missing,
        reached,
        lambda never: (
            f"{len(never)} trainable parameter(s) received no gradient in any of {backwards}"
            f" measured backward(s) (not in the graph of the loss, or detached):"
            f" {shown_names(never)}"
        ),
        lambda some: (
            f"{len(some)} trainable parameter(s) received no gradient in some of {backwards}"
            f" measured backward(s) and one in another ({SKIPPED_SOME_STEPS}):"
            f" {shown_names(some)}"
        ),
    )


def check_changed_without_gradient(
    unchanged: Sequence[str], reached: Collection[str], updates: int = 1
) -> CheckResult:
    """``trainable_params_changed`` for the ``unchanged`` trainable parameters that had no
    gradient at a measured update (torch skips them): pass, named, for those ``reached`` in
    another of the ``updates`` measured backwards; fail for the others."""
    return _over_updates(
        "trainable_params_changed",
        unchanged,
        reached,
        lambda never: (
            f"{len(never)} trainable parameter(s) that received no gradient in any measured"
            f" backward did not change in the update: {shown_names(never)}"
        ),
        lambda some: _skipped_updates(some, updates),
    )


def _skipped_updates(names: Sequence[str], updates: int) -> str:
    return (
        f"{len(names)} trainable parameter(s) had no gradient at some of {updates} measured"
        f" update(s), so the optimizer skipped them there, and received one in another"
        f" ({SKIPPED_SOME_STEPS}): {shown_names(names)}"
    )


def check_gradients(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    optimized: Collection[int],
    intended: Collection[int] | None = None,
    *,
    trainable_at_start: Collection[int] | None = None,
    optimizers: Sequence[Collection[int]] = (),
    reached: Collection[str] = (),
    backwards: int = 1,
) -> list[CheckResult]:
    """Every parameter an optimizer updates (``id`` in ``optimized``) can learn, received a
    gradient, and it is finite (docs/phase-table.md, "Frozen parameters in the optimizer").

    One without a gradient is judged by :func:`check_reached`. One with ``requires_grad=False``
    is skipped when ``intended`` (ids switched off for this backward) holds it, fails when
    ``trainable_at_start`` holds it (frozen mid-fit), else passes or warns (frozen before the
    fit). An optimizer (``optimizers``: the ids of each; default ``optimized``) with nothing
    that can learn fails."""
    named = list(named_parameters)
    off = set() if intended is None else set(intended)
    frozen, switched_off, lost, missing, stray = [], [], [], [], []
    with_grad: list[tuple[str, torch.Tensor]] = []
    sizes: dict[str, int] = {}
    cold: set[int] = set()  # frozen now, and not switched off for this backward
    for name, param in named:
        in_optimizer = id(param) in optimized
        if in_optimizer:
            sizes[name] = param.numel()
        if not (param.requires_grad or id(param) in off):
            cold.add(id(param))
        if in_optimizer and not param.requires_grad:
            if id(param) in off:
                switched_off.append(name)
            elif trainable_at_start is not None and id(param) in trainable_at_start:
                lost.append(name)
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
    bad_grads = f"non-finite gradients in {len(nonfinite)} parameter(s): {shown_names(nonfinite)}"
    seen = {id(param) for _, param in named}
    groups = [set(g) & seen for g in (optimizers or [optimized])]
    dead = [i for i, group in enumerate(groups) if group and group <= cold]
    names = [name for name, _ in named]
    frozen_names = {name for name, param in named if id(param) in cold}
    before_fit = _frozen_before_fit(names, frozen_names, frozen, sizes) if frozen else None
    results = [
        _requires_grad(dead, len(groups), lost, before_fit, switched_off),
        check_reached(missing, reached, backwards),
        _judged("grads_finite", bad_grads if nonfinite else None),
    ]
    if stray:
        detail = (
            f"{len(stray)} parameter(s) receive gradients but no optimizer updates them:"
            f" {shown_names(stray)}"
        )
        results.append(CheckResult("grads_without_optimizer", "warn", detail))
    return results


def _requires_grad(
    dead: Sequence[int],
    n_optimizers: int,
    lost: Sequence[str],
    before_fit: tuple[str, str] | None,
    switched_off: Sequence[str],
) -> CheckResult:
    """``trainable_params_require_grad``: one part per cause (``dead``: indices of the optimizers
    with nothing that can learn; ``lost``: frozen mid-fit; ``before_fit``: the verdict and detail
    of those frozen before it; ``switched_off``: for this backward), the worst verdict of all."""
    parts: list[tuple[str, str]] = []
    if dead:
        which = (
            "the optimizer" if n_optimizers == 1 else f"optimizer(s) {', '.join(map(str, dead))}"
        )
        detail = (
            f"every parameter of {which} has requires_grad=False: nothing it updates can learn;"
            " set requires_grad=True on what should train before the fit (or give the optimizer"
            " the parameters that train)"
        )
        parts.append(("fail", detail))
    if lost:
        detail = (
            f"{len(lost)} parameter(s) were trainable at the first backward of the fit, are in the"
            " optimizer and now have requires_grad=False, so they stopped learning mid-fit:"
            f" {shown_names(lost)}; find the hook or callback that froze them, or, if freezing"
            " them was meant, take them out of the optimizer"
        )
        parts.append(("fail", detail))
    if before_fit is not None:
        parts.append(before_fit)
    if switched_off:
        detail = (
            f"{len(switched_off)} parameter(s) switched off for this backward (e.g. by"
            f" toggle_optimizer) were skipped: {shown_names(switched_off)}"
        )
        parts.append(("pass", detail))
    verdict = worst_verdict(v for v, _ in parts) if parts else "pass"
    return CheckResult("trainable_params_require_grad", verdict, "; ".join(d for _, d in parts))


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
    """Names of the parameters whose gradient exists and is exactly zero in every element."""
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
    without_grad: Collection[str] = (),
    reached: Collection[str] | None = (),
    updates: int = 1,
) -> list[CheckResult]:
    """Trainable parameters changed, the others did not, and the step advanced by one;
    ``zero_lr`` and ``zero_grad`` parameters are named, never failed (docs/phase-table.md).

    An unchanged trainable parameter without a gradient at this update (``without_grad``) is
    judged by :func:`check_changed_without_gradient` (``reached``: names that got a gradient in
    a measured backward), or left out when ``reached`` is ``None`` (judged later)."""
    unchanged = [n for n in before if n in trainable and before[n] == after.get(n)]
    skipped = [n for n in unchanged if n in without_grad]
    unchanged = [n for n in unchanged if n not in without_grad]
    if reached is not None:
        unchanged += [n for n in skipped if n not in reached]
        skipped = [n for n in skipped if n in reached]
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
    if reached is not None and skipped:
        notes.append(_skipped_updates(skipped, updates))
    note = "; ".join(notes)
    problem = (
        f"{len(unchanged)} trainable parameter(s) with a nonzero or missing gradient did not"
        f" change in the update: {shown_names(unchanged)}" + (f"; {note}" if note else "")
    )
    step = f"global_step went from {step_before} to {step_after} in one update; expected +1"
    return [
        _judged("trainable_params_changed", problem if unchanged else None, passed=note),
        _judged(
            "frozen_params_unchanged",
            f"{len(moved)} frozen parameter(s) changed: {shown_names(moved)}" if moved else None,
        ),
        _judged("step_counted", step if step_after - step_before != 1 else None),
    ]


def _train_mode_kind(module: torch.nn.Module | None) -> tuple[int, str]:
    """``(tier, label)``: 0 changes the outputs in train mode, 1 a leaf of unknown type, 2 not."""
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


def _tiered(entries: Iterable[tuple[str, torch.nn.Module | None]]) -> list[list[str]]:
    """The modules by tier of :func:`_train_mode_kind`, each shown as ``name (kind)``."""
    tiers: list[list[str]] = [[], [], []]
    for name, module in entries:
        tier, label = _train_mode_kind(module)
        tiers[tier].append(f"{name} ({label})" if label else name)
    return tiers


def check_eval_mode(
    training_modules: Iterable[tuple[str, torch.nn.Module] | str],
    grad_enabled: bool,
    phase: str = "validation",
) -> list[CheckResult]:
    """During evaluation every module is in eval mode and autograd is off (``training_modules``:
    ``(name, module)``, or a bare name, of every module found in train mode)."""
    entries = ((e, None) if isinstance(e, str) else e for e in training_modules)
    changing, unknown, inert = _tiered(entries)
    total = len(changing) + len(unknown) + len(inert)
    no_grad = f"autograd was enabled during {phase} (memory for activations is kept)"
    no_grad_result = _judged("no_grad", no_grad if grad_enabled else None)
    if changing or unknown:
        parts = []
        if changing:
            parts.append(
                f"{len(changing)} module(s) whose outputs change in train mode during {phase}:"
                f" {shown_names(changing)}"
            )
        if unknown:
            parts.append(
                f"{len(unknown)} {'more ' if changing else ''}leaf module(s) of types not known"
                f" to be mode-independent: {shown_names(unknown)}"
            )
        parts.append(f"{total} module(s) in train mode in all")
        return [CheckResult("eval_mode", "fail", "; ".join(parts)), no_grad_result]
    inert_detail = (
        f"{len(inert)} module(s) in train mode during {phase}, none of a type known to change the"
        f" outputs (containers and mode-independent layers): {shown_names(inert)};"
        " code that branches on `self.training` still takes its training path"
    )
    return [_judged("eval_mode", inert_detail if inert else None, "warn"), no_grad_result]


def check_train_mode(
    named_modules: Iterable[tuple[str, torch.nn.Module]],
    trainable: Collection[int] | None = None,
) -> CheckResult:
    """During the training step every module that trains is in train mode (``named_modules``:
    the whole model, ``""`` its root; ``trainable``: ids of the parameters meant to train,
    default those with ``requires_grad``). A module in eval mode whose closest module with
    parameters holds no trainable one is frozen on purpose: it passes, named."""
    modules = dict(named_modules)
    asleep = [name for name, module in modules.items() if not module.training]
    if not asleep:
        return CheckResult("train_mode", "pass", "")

    def has_parameters(prefix: str) -> bool:
        return prefix in modules and next(modules[prefix].parameters(), None) is not None

    @functools.cache
    def holds_trainable(owner: str) -> bool:
        params = modules[owner].parameters()
        return any(p.requires_grad if trainable is None else id(p) in trainable for p in params)

    kept: list[str] = []
    judged: list[tuple[str, torch.nn.Module]] = []
    for name in asleep:
        # The closest module holding parameters: in eval mode on purpose when none trains.
        owner = next((p for p in reversed(_prefixes(name)) if has_parameters(p)), None)
        if owner is None or holds_trainable(owner):
            judged.append((name or "<root>", modules[name]))
        else:
            kept.append(name)
    changing, unknown, inert = _tiered(judged)
    parts = []
    if changing:
        parts.append(
            f"{len(changing)} module(s) whose outputs change with the mode are in eval mode"
            f" during the training step: {shown_names(changing)}"
        )
    others = unknown + inert
    if others:
        parts.append(
            f"{len(others)} {'more ' if changing else ''}module(s) in eval mode during the"
            " training step, none of a type known to change the outputs (containers,"
            f" mode-independent layers, unknown leaf types): {shown_names(others)}"
        )
    if kept:
        held = set(kept)
        roots = [n for n in kept if not any(a in held for a in _prefixes(n)[:-1])]
        parts.append(
            f"{len(kept)} module(s) in eval mode hold (or sit in a module holding) only frozen"
            " parameters, kept in eval mode on purpose (a frozen BatchNorm or tower):"
            f" {shown_names([r or '<root>' for r in roots])}"
        )
    remedy = (
        "call .train() on them, or do not call .eval() in on_train_start or another hook"
        " (Lightning does not switch modules back to train mode when training starts)"
    )
    if changing:
        parts.append(f"{len(asleep)} module(s) in eval mode in all; {remedy}")
        return CheckResult("train_mode", "fail", "; ".join(parts))
    if others:
        parts.append(
            "code that branches on `self.training` (dropout rates read in forward, gradient"
            f" checkpointing) takes its eval path; if not intended, {remedy}"
        )
        return CheckResult("train_mode", "warn", "; ".join(parts))
    return CheckResult("train_mode", "pass", "; ".join(parts))


def check_sample_count(seen: int, expected: int | None, why_unknown: str = "") -> CheckResult:
    """The number of samples validated equals the number expected."""
    if expected is None:
        return CheckResult("outputs_complete", "not_checked", why_unknown)
    if seen == expected:
        return CheckResult("outputs_complete", "pass", f"{seen} samples")
    dropped = " (a remainder was dropped: check drop_last)" if seen < expected else ""
    detail = f"{seen} samples validated, expected {expected}{dropped}"
    return CheckResult("outputs_complete", "fail", detail)
