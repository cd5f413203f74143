"""Missing gradients judged over the measured updates of a fit, not one update at a time: a
parameter without a gradient in one measured backward (LayerDrop, an expert no token reached)
fails only when it received one in none (docs/phase-table.md, "Missing gradients")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_pilot.core import checks
from lightning_pilot.core.phases import judge
from lightning_pilot.vocabulary import worst_verdict

#: A deferred check: (phase, whether on the phase's first row, check name).
Key = tuple[str, bool, str]


class GradientEvidence:
    """The names that received a gradient in a measured backward, and per deferred check
    (phase row and check) the names without one, judged by :meth:`results` once the evidence is
    complete. A name once judged as never reached stays so."""

    def __init__(self) -> None:
        self.reached: set[str] = set()
        self.never: set[str] = set()  # judged as never reached: stays so
        self.backwards = 0
        self.updates = 0
        self.deferred: dict[Key, dict[str, None]] = {}
        #: The evidence is complete (the pilot window is over, or the fit ended).
        self.settled = False

    def backward(self, reached: Iterable[str]) -> None:
        """A measured backward: the names of the parameters that received a gradient in it."""
        self.reached.update(reached)
        self.backwards += 1

    def update(self) -> None:
        """A measured optimizer update was judged."""
        self.updates += 1

    def defer(self, key: Key, names: Iterable[str]) -> None:
        """Note ``names`` (without a gradient in a measured occurrence) for the check ``key``."""
        self.deferred.setdefault(key, {}).update(dict.fromkeys(names))

    def settle(self) -> bool:
        """The evidence is complete; ``True`` the first time only."""
        first, self.settled = not self.settled, True
        return first

    def results(self) -> dict[Key, checks.CheckResult]:
        """One result per deferred check (``checks.check_reached`` for ``grads_reach_params``,
        else ``checks.check_changed_without_gradient``)."""
        reached = self.reached - self.never
        results: dict[Key, checks.CheckResult] = {}
        for key, held in self.deferred.items():
            names = list(held)
            if key[2] == "grads_reach_params":
                results[key] = checks.check_reached(names, reached, self.backwards)
            else:
                results[key] = checks.check_changed_without_gradient(names, reached, self.updates)
            self.never.update(n for n in names if n not in reached)
        return results

    def failure(self) -> str | None:
        """The message naming the deferred checks that fail now (``None``: none fails)."""
        failed = [(key, r) for key, r in self.results().items() if r.verdict == "fail"]
        if not failed:
            return None
        named = dict.fromkeys(f"{phase} {r.name}: {r.detail}" for (phase, _, _), r in failed)
        return "failed over the measured updates: " + "; ".join(named)


def merge_deferred(
    row: dict[str, Any], deferred: Mapping[Key, checks.CheckResult]
) -> dict[str, Any]:
    """``row`` (a phase row) with its deferred checks merged into those of the same name (the
    worst verdict, both details), its verdict and reason judged again; ``row`` itself when none
    is its."""
    phase, first = row["phase"], bool(row["first"])
    extra = {k[2]: r for k, r in deferred.items() if k[:2] == (phase, first)}
    if not extra:
        return row
    found = {c["name"]: c for c in row["checks"]}
    for name, result in extra.items():
        own = found.get(name)
        if own is not None:
            verdict = worst_verdict([own["verdict"], result.verdict])
            detail = "; ".join(d for d in (own["detail"], result.detail) if d)
            result = checks.CheckResult(name, verdict, detail)
        found[name] = result.as_row()
    merged = list(found.values())
    verdict, reason = judge(phase, ((c["name"], c["verdict"], c["detail"]) for c in merged))
    return row | {"checks": merged, "verdict": verdict, "reason": reason or row["reason"]}
