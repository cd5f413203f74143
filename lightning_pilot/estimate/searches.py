"""The largest sizes that fit each target, per precision and checkpointing, on one GPU:
:func:`search_largest`, in the precision's open :class:`Session` after the grid's traces. The
largest micro-batch at the longest sequence is predicted affine in the micro-batch (two traced
micro-batches that ran the same operators); the largest sequence length at the smallest
micro-batch quadratic in the length (three traced lengths, :func:`_lagrange`). Each answer is
bisected, then with ``verify_largest`` confirmed by tracing it and the next step (:func:`settle`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from lightning_pilot.estimate.fits import need
from lightning_pilot.estimate.job import Ckpt, GridJob
from lightning_pilot.estimate.precision_traces import PrecisionTraces, later_extra, matching_pair
from lightning_pilot.estimate.recorder import PhaseTrace
from lightning_pilot.estimate.session import Session
from lightning_pilot.estimate.targets import Target

#: The most traces :func:`settle` takes to confirm a predicted largest size.
VERIFY_TRACES: Final = 12
_UNSETTLED: Final = f"traces near the prediction did not settle in {VERIFY_TRACES} tries"
#: The module attributes (and their ``config``'s) that bound the sequence length.
#: ``max_target_positions``: an encoder-decoder whose encoder reads features, not token ids
#: (Whisper), bounds the decoder's tokens with it.
_POSITION_LIMITS: Final = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "max_length",
    "max_target_positions",
)


@dataclass(frozen=True)
class BatchFound:
    """The largest micro-batch search's finding for one target and checkpointing (``status``:
    ``ok``, ``not_estimated`` or the failure's); the sizes only when it ran."""

    status: str
    reason: str | None
    largest: int | None = None
    method: str | None = None
    checked: bool | None = None


@dataclass(frozen=True)
class SeqFound:
    """The largest sequence length search's finding for one target and checkpointing, at
    ``micro_batch`` up to ``bound``; the sizes only when it ran."""

    micro_batch: int
    bound: int
    reason: str | None
    largest: int | None = None
    method: str | None = None
    checked: bool | None = None


def search_largest(
    session: Session, traces: PrecisionTraces, job: GridJob
) -> Iterator[tuple[Target, Ckpt, BatchFound, SeqFound | None]]:
    """Per target and checkpointing of ``job``: the largest micro-batch and, for a batch with a
    sequence dimension, the largest sequence length (``None`` otherwise), each yielded as it
    is found."""
    search = _Search(session, traces, job)
    by_seq: dict[Ckpt, dict[str, SeqFound]] = {}
    for tgt, ckpt in itertools.product(job.targets, job.checkpointing):
        if job.seq_micro_batch is not None and ckpt not in by_seq and ckpt not in traces.failed:
            by_seq[ckpt] = search.largest_seq_len(ckpt, job.seq_micro_batch)
        found = search.largest_micro_batch(tgt, ckpt)
        yield tgt, ckpt, found, by_seq.get(ckpt, {}).get(tgt.name)


def _last_fitting(need_at: Callable[[int], int | None], lo: int, hi: int, capacity: int) -> int:
    """The largest size in ``[lo, hi)`` whose predicted need fits ``capacity``, by bisection:
    ``lo`` is known to fit (or is 0, nothing), ``hi`` known not to."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (need_at(mid) or 0) <= capacity:
            lo = mid
        else:
            hi = mid
    return lo


def settle(fits: Callable[[int], bool], start: int, cap: int) -> tuple[int, bool]:
    """The largest ``b`` up to ``cap`` with ``fits(b)`` (each call a trace), from the
    prediction ``start``: it must fit and ``start + 1`` must not; when one disagrees, the
    boundary is bracketed by doubling steps and bisected (at most :data:`VERIFY_TRACES`
    calls). ``(largest, settled)``."""
    cache: dict[int, bool] = {}  # size -> fits, each traced once
    lo, hi = 0, None  # largest known to fit, smallest known not to
    step = 1
    b = min(max(start, 1), cap)
    while len(cache) < VERIFY_TRACES:
        if hi is not None and hi - lo <= 1:
            return lo, True
        if lo >= cap:
            return cap, True
        if b not in cache:
            cache[b] = fits(b)
        if cache[b]:
            lo = max(lo, b)
            b = min(lo + step, cap) if hi is None else (lo + hi) // 2
        else:
            hi = b if hi is None else min(hi, b)
            if b == 1:
                return 0, True
            b = max(hi - step, 1) if lo == 0 and hi - step > 0 else (lo + hi) // 2
            b = max(b, lo + 1)
        step *= 2
    return lo, (hi is not None and hi - lo <= 1) or lo >= cap


def sequence_bound(module: torch.nn.Module) -> int | None:
    """The longest sequence ``module`` declares it accepts: the smallest positive integer
    ``max_position_embeddings``, ``n_positions``, ``max_seq_len``, ``max_length`` or
    ``max_target_positions`` (Whisper's decoder) of any submodule or its ``config``; ``None``
    when none declares one."""
    found = [
        value
        for sub in module.modules()
        for owner in (sub, getattr(sub, "config", None))
        for value in (getattr(owner, name, None) for name in _POSITION_LIMITS)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0
    ]
    return min(found, default=None)


def _lagrange(xs: Sequence[int], values: Sequence[Any], x: int) -> Any:
    """The polynomial through ``(xs[i], values[i])`` (arrays element by element) at ``x``."""
    total: Any = 0
    for i, xi in enumerate(xs):
        weight = 1.0
        for j, xj in enumerate(xs):
            if j != i:
                weight *= (x - xj) / (xi - xj)
        total = total + weight * np.asarray(values[i], dtype=np.float64)
    return total


def _ceil(value: Any) -> int:
    return math.ceil(float(value) - 1e-6)


def _affine(low: Any, high: Any, base: tuple[int, int], x: int) -> Any:
    """The line through ``low`` at ``base[0]`` and ``high`` at ``base[1]`` (arrays element by
    element) at ``x``, floored."""
    return low + (high - low) * (x - base[0]) // (base[1] - base[0])


@dataclass
class _Search:
    """The searches of one precision: its open session, its traces and the job."""

    session: Session
    traces: PrecisionTraces
    job: GridJob

    def largest_micro_batch(self, tgt: Target, ckpt: Ckpt) -> BatchFound:
        """The largest micro-batch at the longest sequence, predicted from the base traces
        and checked by tracing it and the next one."""
        traces, seq_len = self.traces, self.job.longest
        verify, cap = self.job.verify_largest, self.job.max_micro_batch
        if ckpt in traces.failed:
            status, _, failure = traces.failed[ckpt]
            return BatchFound(status, failure)
        # Validation at a micro-batch may be extrapolated (from two smaller ones that ran the
        # same operators) where training was traced: its operators are theirs.
        traced = {
            b: [t["forward"], t["backward"], traces.resolved_validation[(seq_len, b)][0]]
            for (c, q, b), t in traces.train.items()
            if (c, q) == (ckpt, seq_len) and (seq_len, b) in traces.resolved_validation
        }
        pair = matching_pair(traced, 1 << 62)
        if pair is None:
            return BatchFound("not_estimated", "no two traced micro-batches ran the same operators")
        need_at = functools.partial(self._predicted_need, tgt, ckpt, pair)
        first = need_at(1)
        if first is None:
            return BatchFound(
                "not_estimated", "the two traced micro-batches ran different operators"
            )
        if first > tgt.memory_bytes:
            checked = verify and not self._fits(tgt, ckpt, seq_len, 1)
            why = "micro-batch 1 does not fit"
            if verify and not checked:
                why += " as predicted, but fits as traced"
            method = "predicted, traced" if verify else "predicted"
            return BatchFound("ok", why, largest=0, method=method, checked=checked)
        lo, hi = 1, 2
        while hi <= cap and (need_at(hi) or 0) <= tgt.memory_bytes:
            lo, hi = hi, hi * 2
        if hi > cap and (need_at(cap) or 0) <= tgt.memory_bytes:
            why = f"fits at max_micro_batch={cap}, the end of the search"
            return BatchFound("ok", why, largest=cap, method="predicted", checked=False)
        lo = _last_fitting(need_at, lo, min(hi, cap + 1), tgt.memory_bytes)
        if not verify:
            return BatchFound("ok", None, largest=lo, method="predicted", checked=False)
        found, checked = settle(lambda b: self._fits(tgt, ckpt, seq_len, b), lo, cap)
        method = "predicted, traced" if found == lo else "predicted, corrected by tracing"
        reason = None if checked else _UNSETTLED
        return BatchFound("ok", reason, largest=found, method=method, checked=checked)

    def _predicted_need(
        self, tgt: Target, ckpt: Ckpt, base: tuple[int, int], micro_batch: int
    ) -> int | None:
        """The most memory any phase needs at ``micro_batch``: every operator's live bytes
        moved linearly from the two base traces (``None`` when they ran different
        operators)."""
        lows, highs = (self._resolved(ckpt, b) for b in base)
        peaks, segments = [], []
        for low, high in zip(lows, highs, strict=True):
            if low.signature != high.signature or low.curve.shape != high.curve.shape:
                return None
            curve = _affine(low.curve, high.curve, base, micro_batch)
            start = _affine(low.start_bytes, high.start_bytes, base, micro_batch)
            peaks.append(max(int(curve.max()), start))
            segments.append(_affine(low.segment_bytes, high.segment_bytes, base, micro_batch))
        low_batch, high_batch = (phase.categories["batch"] for phase in (lows[0], highs[0]))
        batch_bytes = _affine(low_batch, high_batch, base, micro_batch)
        return self._need(tgt, lows, peaks, segments, batch_bytes)

    def _resolved(self, ckpt: Ckpt, micro_batch: int) -> list[PhaseTrace]:
        """Forward, backward and validation at the longest sequence, as the grid resolved them."""
        seq_len = self.job.longest
        train = self.traces.resolved_train[(ckpt, seq_len, micro_batch)][0]
        validation = self.traces.resolved_validation[(seq_len, micro_batch)][0]
        return [train["forward"], train["backward"], validation]

    def _need(
        self,
        tgt: Target,
        phases: Sequence[PhaseTrace],
        peaks: Sequence[int],
        segments: Sequence[int],
        batch_bytes: int,
    ) -> int:
        """The most memory any phase needs: forward, backward and validation (``phases``) at
        ``peaks`` and ``segments``, the passes with what a later update holds beside them, and
        the phases without activations with the training batch of ``batch_bytes``."""
        worst = 0
        for index, (trace, peak, segment) in enumerate(zip(phases, peaks, segments, strict=True)):
            extra = sum(later_extra(trace, self.traces).values()) if index < 2 else 0
            worst = max(worst, need(peak + extra + tgt.workspace_bytes, segment + extra, tgt))
        for trace in self.traces.optimizer.values():
            peak = trace.peak_bytes + batch_bytes + tgt.workspace_bytes
            worst = max(worst, need(peak, trace.segment_bytes + batch_bytes, tgt))
        if self.traces.save is not None:
            peak = self.traces.save.peak_bytes + tgt.workspace_bytes
            worst = max(worst, need(peak, self.traces.save.segment_bytes, tgt))
        return worst

    def _phases_at(self, ckpt: Ckpt, seq_len: int | None, micro_batch: int) -> list[PhaseTrace]:
        """Forward, backward and validation at one size: traced by the grid or an earlier
        search step, else traced now (and kept for the next step)."""
        traces, session, batch = self.traces, self.session, self.job.batch
        key = (ckpt, seq_len, micro_batch)
        if key not in traces.searched:
            train = traces.train.get(key) or session.train_phases(
                batch, micro_batch=micro_batch, seq_len=seq_len, checkpointing=ckpt
            )
            val = traces.validation.get((seq_len, micro_batch)) or session.validation_phase(
                batch, micro_batch=micro_batch, seq_len=seq_len
            )
            traces.searched[key] = (train, val)
        train, val = traces.searched[key]
        return [train["forward"], train["backward"], val]

    def _fits(self, tgt: Target, ckpt: Ckpt, seq_len: int | None, micro_batch: int) -> bool:
        """Whether every phase fits ``tgt`` at this size, traced."""
        phases = self._phases_at(ckpt, seq_len, micro_batch)
        peaks = [trace.peak_bytes for trace in phases]
        segments = [trace.segment_bytes for trace in phases]
        batch = phases[0].categories["batch"]
        return self._need(tgt, phases, peaks, segments, batch) <= tgt.memory_bytes

    def largest_seq_len(self, ckpt: Ckpt, micro_batch: int) -> dict[str, SeqFound]:
        """Per target name: the largest sequence length (a multiple of the step) that fits at
        ``micro_batch``, up to the module's declared bound or ``max_seq_len``; predicted from
        three traced lengths, then settled by tracing it and the next step."""
        traces, job = self.traces, self.job
        bound = sequence_bound(self.session.module)
        if bound is None:
            cap, why_cap = job.max_seq_len, f"max_seq_len={job.max_seq_len}, the end of the search"
        else:
            cap, why_cap = bound, f"the module's declared maximum ({bound} positions)"
        step = job.seq_step
        while step > 1 and cap // step < 8:
            step //= 2
        top = cap // step
        # Three lengths: the bound, and a third and two thirds of it, or a length the grid
        # traced already at this micro-batch in their place.
        units = [max(1, top // 3), max(2, 2 * top // 3), top]
        for known_ckpt, known_seq, known_b in traces.train:
            if (known_ckpt, known_b) == (ckpt, micro_batch) and known_seq and known_seq % step == 0:
                unit = known_seq // step
                if 0 < unit < top and unit not in units:
                    nearest = min(range(2), key=lambda i: abs(units[i] - unit))
                    units[nearest] = unit
        units = sorted(set(units))
        points: dict[int, list[PhaseTrace]] = {}
        try:
            if len(units) < 3:
                raise ValueError(f"the bound {cap} holds fewer than 3 steps of {step}")
            for unit in units:
                points[unit * step] = self._phases_at(ckpt, unit * step, micro_batch)
        except Exception as err:  # the module refuses a length: the search cannot run
            failure = f"sequence lengths could not be traced: {type(err).__name__}: {err}"
            return {t.name: SeqFound(micro_batch, cap, failure) for t in job.targets}
        found: dict[str, SeqFound] = {}
        for tgt in job.targets:
            need_at = functools.partial(self._seq_need, points, tgt, step)
            if need_at(1) is None:
                different = "the traced sequence lengths ran different operators"
                found[tgt.name] = SeqFound(micro_batch, cap, different)
                continue
            lo = _last_fitting(need_at, 0, top + 1, tgt.memory_bytes)
            method, checked = "predicted (quadratic in the sequence length)", False
            reason = None if lo else f"one step ({step}) does not fit"
            if job.verify_largest:

                def fits(unit: int, tgt: Target = tgt) -> bool:
                    return self._fits(tgt, ckpt, unit * step, micro_batch)

                settled, checked = settle(fits, max(lo, 1), top)
                method += ", traced" if settled == lo else ", corrected by tracing"
                lo = settled
                if not checked:
                    reason = _UNSETTLED
            if lo == top and reason is None:
                reason = f"fits at {why_cap}"
            found[tgt.name] = SeqFound(
                micro_batch, cap, reason, largest=lo * step, method=method, checked=checked
            )
        return found

    def _seq_need(
        self, points: Mapping[int, Sequence[PhaseTrace]], tgt: Target, step: int, unit: int
    ) -> int | None:
        """The most memory any phase needs at ``unit`` steps of ``step`` tokens: every
        operator's live bytes (and the start, the allocator's segments and the batch) through
        the polynomial of the traced sequence lengths ``points`` (three: quadratic, as
        attention's T x T terms are); ``None`` when they ran different operators."""
        xs, seq_len = sorted(points), unit * step
        peaks, segments = [], []
        for index in range(3):  # forward, backward, validation
            phases = [points[x][index] for x in xs]
            if len({(p.signature, p.curve.shape) for p in phases}) != 1:
                return None
            curve = _lagrange(xs, [p.curve for p in phases], seq_len)
            start = _lagrange(xs, [p.start_bytes for p in phases], seq_len)
            peaks.append(_ceil(max(float(curve.max(initial=0)), float(start))))
            segments.append(_ceil(_lagrange(xs, [p.segment_bytes for p in phases], seq_len)))
        batch = _ceil(_lagrange(xs, [points[x][0].categories["batch"] for x in xs], seq_len))
        return self._need(tgt, points[xs[0]], peaks, segments, batch)
