"""Effective-batch counting without Lightning or torch (docs/effective-batch.md):
:class:`UpdateCounter` counts micro-batches into updates, :func:`summarize` compares the count with
the plan of :mod:`lightning_pilot.core.update_plan`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, astuple, dataclass, field, fields
from typing import Any, ClassVar, Final

from lightning_pilot.core.phases import CheckResult
from lightning_pilot.core.update_plan import (
    MAX_LISTED,
    TOKENS_NOT_COUNTED,
    Keep,
    UpdatePlan,
    effective_batch_text,
    last_window_text,
)


@dataclass(frozen=True)
class BatchConfig:
    """The configuration a fit really runs with (``accumulate_grad_batches``: ``K`` when
    training starts; ``micro_batch_size``: ``None`` until known)."""

    micro_batch_size: int | None
    accumulate_grad_batches: int
    dp_replicas: int

    @property
    def effective_batch_size(self) -> int | None:
        """Examples per full update over all replicas; ``None`` while the micro-batch is unknown."""
        b = self.micro_batch_size
        return None if b is None else b * self.accumulate_grad_batches * self.dp_replicas


@dataclass(frozen=True)
class PartialWindow:
    """An update that stepped fewer than ``K`` micro-batches (``examples``: all replicas)."""

    update: int
    epoch: int
    batch_idx_last: int
    micro_batches: int
    accumulate_grad_batches: int
    weight: float
    examples: int | None


@dataclass(frozen=True)
class KChange:
    """``accumulate_grad_batches`` went from ``old`` to ``new`` at ``update``."""

    update: int
    old: int
    new: int


@dataclass(frozen=True)
class TokenSpread:
    """Tokens per full update over all replicas: how many updates, min, max, max/min, CV."""

    updates: int
    min: int | None
    max: int | None
    ratio: float | None
    cv: float | None


@dataclass
class _Window:
    epoch: int
    batch_first: int
    batch_last: int
    micro_batches: int = 0
    examples: int | None = 0
    tokens: list[Any] | None = field(default_factory=list)  # counts, some maybe unread
    tokens_source: str | None = None
    duplicates: int | None = 0


def _add(total: int | None, value: int | None) -> int | None:
    return None if total is None or value is None else total + value


#: Columns summed over the data-parallel replicas into ``<column>_all_ranks``.
SUMMED_COLUMNS: Final = ("micro_batches", "examples", "tokens", "padding_duplicates")


@dataclass
class UpdateCounter:
    """Counts micro-batches into updates, one row per window closed by an update, and keeps the
    totals: the caller fills the ``*_all_ranks`` columns of :meth:`take_pending`'s rows and hands
    them to :meth:`absorb`. ``updates`` counts optimizer steps as ``global_step`` does: a row
    whose ``update`` is ``n`` past the previous one fed ``n`` steps (a batch stepping several
    optimizers), the ``n - 1`` beyond one per window kept in ``extra_steps``."""

    STATE_VERSION: ClassVar[int] = 1

    updates: int = 0
    micro_batches: int = 0
    examples: int | None = 0
    tokens: int | None = 0
    tokens_source: str | None = None
    duplicates: int | None = 0
    partial_window_count: int = 0
    partial_windows: list[PartialWindow] = field(default_factory=list)
    skipped_count: int = 0
    skipped_updates: list[int] = field(default_factory=list)
    k_changes: list[KChange] = field(default_factory=list)
    last_k: int | None = None
    last_update: int | None = None
    counted_from: int = 0
    extra_steps: int = 0
    # Full updates' tokens: count, min, max, sum, sum of squares (for the spread).
    token_stats: list[Any] = field(default_factory=lambda: [0, None, None, 0.0, 0.0])

    def __post_init__(self) -> None:
        self._window: _Window | None = None
        self.pending: list[dict[str, Any]] = []

    @property
    def open_micro_batches(self) -> int:
        """Micro-batches counted since the last update (0 between windows)."""
        return 0 if self._window is None else self._window.micro_batches

    def add_micro_batch(
        self,
        *,
        epoch: int,
        batch_idx: int,
        examples: int | None,
        tokens: Any,
        tokens_source: str | None = None,
        duplicates: int | None = 0,
    ) -> None:
        """Count one micro-batch of this process (``None``: the value could not be read);
        ``tokens`` may be a 0-d tensor still on the device, read in :meth:`take_pending`."""
        window = self._window or _Window(epoch, batch_idx, batch_idx, tokens_source=tokens_source)
        self._window = window
        window.batch_last = batch_idx
        window.micro_batches += 1
        window.examples = _add(window.examples, examples)
        if window.tokens is not None:
            window.tokens = None if tokens is None else [*window.tokens, tokens]
        if window.tokens_source != tokens_source:
            window.tokens_source = None
        window.duplicates = _add(window.duplicates, duplicates)

    def close_update(
        self, *, update: int, accumulate_grad_batches: int | None, stepped: bool | None = None
    ) -> None:
        """Close the open window as update ``update`` (``global_step`` after it) into a row of
        :attr:`pending`; ``stepped``: ``False`` when a GradScaler skipped the step, ``None``
        when not observed. ``accumulate_grad_batches=None`` (manual optimization: the module
        steps when its window is complete) takes the window's micro-batches as ``K``."""
        window = self._window or _Window(epoch=-1, batch_first=-1, batch_last=-1)
        self._window = None
        k = accumulate_grad_batches or max(window.micro_batches, 1)
        self.pending.append(
            {
                "update": update,
                "epoch": window.epoch,
                "batch_idx_first": window.batch_first,
                "batch_idx_last": window.batch_last,
                "accumulate_grad_batches": k,
                "micro_batches": window.micro_batches,
                "examples": window.examples,
                "tokens": window.tokens if window.tokens_source is not None else None,
                "tokens_source": window.tokens_source,
                "padding_duplicates": window.duplicates,
                "window_partial": window.micro_batches < k,
                "weight": window.micro_batches / k,
                "optimizer_stepped": stepped,
            }
        )

    def take_pending(
        self, read: Callable[[list[Any]], Sequence[float]] | None = None
    ) -> list[dict[str, Any]]:
        """Hand over (and forget) the pending rows, their token counts read: ``read`` reads every
        count not an int yet at once (``read_scalars``: one host sync); default ``int`` each."""
        rows, self.pending = self.pending, []
        lazy = [t for row in rows for t in row["tokens"] or () if not isinstance(t, int)]
        values = iter(read(lazy) if read is not None else [int(t) for t in lazy])
        for row in rows:
            parts = row["tokens"]
            if parts is None:
                row["notes"] = TOKENS_NOT_COUNTED
            else:
                row["tokens"] = sum(t if isinstance(t, int) else int(next(values)) for t in parts)
        return rows

    @staticmethod
    def local_as_all_ranks(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rows of a single process: the all-ranks columns are the local ones."""
        return [row | {f"{c}_all_ranks": row[c] for c in SUMMED_COLUMNS} for row in rows]

    def absorb(self, rows: Iterable[dict[str, Any]]) -> None:
        """Add rows whose ``*_all_ranks`` columns are filled to the totals and findings."""
        for row in rows:
            update = int(row["update"])
            steps = update - (self.counted_from if self.last_update is None else self.last_update)
            self.last_update = update
            self.updates += steps
            self.extra_steps += steps - 1
            self.micro_batches += int(row["micro_batches_all_ranks"] or 0)
            self.examples = _add(self.examples, row["examples_all_ranks"])
            self.tokens = _add(self.tokens, row["tokens_all_ranks"])
            self.tokens_source = self.tokens_source or row.get("tokens_source")
            self.duplicates = _add(self.duplicates, row["padding_duplicates_all_ranks"])
            k = int(row["accumulate_grad_batches"])
            if self.last_k not in (None, k) and len(self.k_changes) < MAX_LISTED:
                self.k_changes.append(KChange(update, self.last_k, k))
            self.last_k = k
            if row["window_partial"]:
                self.partial_window_count += 1
                if len(self.partial_windows) < MAX_LISTED:
                    window = PartialWindow(
                        update=update,
                        epoch=int(row["epoch"]),
                        batch_idx_last=int(row["batch_idx_last"]),
                        micro_batches=int(row["micro_batches"]),
                        accumulate_grad_batches=k,
                        weight=float(row["weight"]),
                        examples=row["examples_all_ranks"],
                    )
                    self.partial_windows.append(window)
            elif (tokens := row["tokens_all_ranks"]) is not None:
                count, low, high, total, total_sq = self.token_stats
                self.token_stats = [
                    count + 1,
                    tokens if low is None else min(low, tokens),
                    tokens if high is None else max(high, tokens),
                    total + tokens,
                    total_sq + float(tokens) * tokens,
                ]
            if row.get("optimizer_stepped") is False:
                self.skipped_count += 1
                if len(self.skipped_updates) < MAX_LISTED:
                    self.skipped_updates.append(update)

    def resume_at(self, global_step: int) -> str | None:
        """Line the counts up with a fit resumed at ``global_step``; a note when they differ
        (after a checkpoint without counts the totals are ``None``)."""
        counted, self.last_update = self.counted_from + self.updates, global_step
        if global_step == counted:
            return None
        if counted:
            return (
                f"the checkpoint's counts cover {counted} updates but training resumed at"
                f" update {global_step}"
            )
        self.counted_from = global_step
        self.examples = self.tokens = self.duplicates = None
        return (
            f"resumed at update {global_step} from a checkpoint without accountant counts:"
            " examples and tokens before it are unknown"
        )

    @property
    def token_spread(self) -> TokenSpread:
        """Tokens per full update over all replicas: count, min, max, max/min and the CV."""
        count, low, high, total, total_sq = self.token_stats
        cv = None
        if count >= 2 and total > 0:
            mean = total / count
            cv = math.sqrt(max(total_sq / count - mean * mean, 0.0)) / mean
        return TokenSpread(count, low, high, high / low if low and high is not None else None, cv)

    def state_dict(self) -> dict[str, Any]:
        """The absorbed totals and findings (weights-only-safe types only)."""
        return {"version": self.STATE_VERSION, **asdict(self)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (missing keys keep their defaults)."""
        fresh = UpdateCounter()
        for name in (f.name for f in fields(self)):
            setattr(self, name, state.get(name, getattr(fresh, name)))
        self.partial_windows = [PartialWindow(**w) for w in state.get("partial_windows", [])]
        self.k_changes = [KChange(**c) for c in state.get("k_changes", [])]
        self.token_stats = list(self.token_stats)


def pack_counts(rows: Sequence[Mapping[str, Any]], length: int) -> list[list[int]]:
    """This rank's rows as integers to sum over ranks in one all-reduce: ``[1, value, known, ...]``
    over :data:`SUMMED_COLUMNS` (``known``: 0 for null), zero rows padding to ``length``."""
    packed = [
        [1, *(v for c in SUMMED_COLUMNS for v in (int(row[c] or 0), int(row[c] is not None)))]
        for row in rows
    ]
    return packed + [[0] * (1 + 2 * len(SUMMED_COLUMNS)) for _ in range(length - len(rows))]


def unpack_sums(
    rows: Sequence[Mapping[str, Any]],
    sums: Sequence[Sequence[int]],
    *,
    world_size: int,
    dp_replicas: int,
) -> list[dict[str, Any]]:
    """Fill this rank's ``*_all_ranks`` columns from the summed :func:`pack_counts`, divided by
    the ranks sharing a batch (null, with a note, when not every rank counted)."""
    group, uneven = divmod(world_size, dp_replicas)
    out = []
    for row, packed in zip(rows, sums, strict=False):
        filled, notes = dict(row), []
        if uneven:
            notes.append(f"world size {world_size} is not a multiple of {dp_replicas} replicas")
        if packed[0] != world_size:
            notes.append(f"only {packed[0]} of {world_size} ranks counted this update")
        for j, column in enumerate(SUMMED_COLUMNS):
            value, known = packed[1 + 2 * j], packed[2 + 2 * j]
            ok = not notes and known == world_size and value % group == 0
            filled[f"{column}_all_ranks"] = value // group if ok else None
        if notes:
            filled["notes"] = "; ".join([*([row["notes"]] if row.get("notes") else []), *notes])
        out.append(filled)
    return out


def _epoch_length_remedy(micro_batches: int, k: int) -> str:
    # The divisors of the epoch length closest to K from below and above (1 when none).
    divisors = [d for d in range(2, micro_batches + 1) if micro_batches % d == 0]
    near_k = [d for d in divisors if d < k][-1:] + [d for d in divisors if d > k][:1] or [1]
    near = " or ".join(str(d) for d in near_k)
    rest = micro_batches % k
    return (
        f"micro-batches per epoch ({micro_batches}) are not a multiple of"
        f" accumulate_grad_batches ({k}): choose K dividing {micro_batches} (e.g. {near}), or"
        " limit_train_batches to a multiple of K, or accept that each epoch's last update"
        f" sees {rest}/{k} of the examples"
    )


def partial_window_remedy(
    plan: UpdatePlan | None, k: int, batch_idx_last: int | None = None
) -> str:
    """What to do about a partial window of ``K = k``, for the cause the plan (else
    ``batch_idx_last``, where the window ended) shows (docs/effective-batch.md).

    Example:
        >>> from lightning_pilot.core.update_plan import plan_updates
        >>> print(partial_window_remedy(plan_updates(64, 1, 5, epochs=1), k=5))
        micro-batches per epoch (64) are not a multiple of accumulate_grad_batches (5): choose K
        dividing 64 (e.g. 4 or 8), or limit_train_batches to a multiple of K, or accept that
        each epoch's last update sees 4/5 of the examples
        >>> print(partial_window_remedy(plan_updates(81, 2, 5, epochs=1), k=5))
        the loader's last micro-batch is partial (81 examples per replica are not a multiple of
        batch_size 2) and makes 41 micro-batches per epoch where 40 would fill every window of
        accumulate_grad_batches (5): use drop_last=True
    """
    other = (
        "the partial window did not come from the epoch length: a resume from a checkpoint"
        " saved inside a window (Lightning does not replay its micro-batches) or a loader that"
        " yielded fewer batches than its length; see batch_idx_first/batch_idx_last in"
        " updates.parquet"
    )
    if plan is None:
        if batch_idx_last is None or (batch_idx_last + 1) % k == 0:
            return other
        return _epoch_length_remedy(batch_idx_last + 1, k) + " (no plan: counted in its epoch)"
    n = plan.micro_batches_per_epoch
    if n % k == 0:
        return f"micro-batches per epoch ({n}) are a multiple of K ({k}), so {other}"
    b, share = plan.micro_batch_size, plan.samples_per_replica
    loader_partial = not plan.drop_last and share % b != 0 and n == math.ceil(share / b)
    dropped = share // b
    if loader_partial and dropped and dropped % k == 0:
        return (
            f"the loader's last micro-batch is partial ({share} examples per replica are not a"
            f" multiple of batch_size {b}) and makes {n} micro-batches per epoch where"
            f" {dropped} would fill every window of accumulate_grad_batches ({k}):"
            " use drop_last=True"
        )
    remedy = _epoch_length_remedy(n, k)
    if loader_partial:
        remedy += f" (drop_last=True alone leaves {dropped}, not a multiple of {k} either)"
    return remedy


def _partial_windows_text(counter: UpdateCounter, plan: UpdatePlan | None) -> str:
    first = counter.partial_windows[0]
    weights = sorted({f"{w.weight:.2f}" for w in counter.partial_windows})
    total = counter.counted_from + counter.updates
    remedy = partial_window_remedy(plan, first.accumulate_grad_batches, first.batch_idx_last)
    return (
        f"{counter.partial_window_count} of {total:,} update(s) stepped an incomplete"
        f" accumulation window (first: update {first.update}, {first.micro_batches} of"
        f" {first.accumulate_grad_batches} micro-batches); Lightning still divides the loss"
        f" by K, so their examples got weight {', '.join(weights)} of a full update; {remedy}"
    )


def check_accumulation_windows(
    counter: UpdateCounter, plan: UpdatePlan | None = None
) -> CheckResult | None:
    """``partial_accumulation_windows`` over the counted updates (docs/effective-batch.md);
    ``None`` when no update was counted or ``K = 1`` throughout."""
    name = "partial_accumulation_windows"
    if counter.partial_window_count:
        return CheckResult(name, "warn", _partial_windows_text(counter, plan))
    ks = [counter.last_k or 1] + [c.old for c in counter.k_changes]
    if counter.updates == 0 or max(ks) <= 1:
        return None
    k = "/".join(str(v) for v in dict.fromkeys(sorted(ks)))
    detail = (
        f"all {counter.updates:,} update(s) counted stepped full windows of K={k} micro-batches"
    )
    return CheckResult(name, "pass", detail)


@dataclass(frozen=True)
class Flag:
    """A finding of :func:`summarize`: its name (``last_window_partial``, ...) and detail."""

    flag: str
    detail: str


#: The fields of a :class:`Summary` the run's ledger records.
_LEDGER_FIELDS: Final = (
    "micro_batch_size",
    "accumulate_grad_batches",
    "dp_replicas",
    "effective_batch_size",
    "planned_updates",
    "updates_done",
    "examples_seen",
    "tokens_seen",
)


@dataclass(frozen=True)
class Summary:
    """Plan against count: configuration, planned and counted quantities, ``flags`` (findings)
    and ``line`` (for humans), named as in the ledger and ``UpdatePlan``."""

    micro_batch_size: int | None
    accumulate_grad_batches: int
    dp_replicas: int
    effective_batch_size: int | None
    planned_updates: int | None
    planned_examples: int | None
    planned_epochs: int | None
    estimated_stepping_batches: int | None
    updates_done: int
    examples_seen: int | None
    tokens_seen: int | None
    tokens_source: str | None
    epochs_done: int
    micro_batches: int
    padding_duplicates: int | None
    partial_windows: int
    skipped_updates: int
    k_changes: list[KChange]
    tokens_per_update: TokenSpread
    keep: Keep
    kept_planned: int | None
    kept_done: int | None
    flags: list[Flag]
    line: str

    def as_dict(self) -> dict[str, Any]:
        """Plain (JSON-ready) values: ``flags`` as ``{"flag", "detail"}`` dicts, and so on."""
        return asdict(self)

    def ledger_fields(self) -> dict[str, Any]:
        """The run's ledger fields this summary gives."""
        return {name: getattr(self, name) for name in _LEDGER_FIELDS}


def summarize(
    *,
    counter: UpdateCounter,
    config: BatchConfig,
    plan: UpdatePlan | None,
    keep: Keep,
    epochs_done: int,
    planned_epochs: int | None = None,
    estimated_updates: int | None = None,
    token_spread_ratio: float = 1.5,
    notes: Sequence[str] = (),
    unsummed: int = 0,
) -> Summary:
    """Compare the plan with the count and name every finding (docs/effective-batch.md);
    ``unsummed`` updates (never summed over ranks) count as done, with unknown examples."""
    flags: list[Flag] = []
    updates_done = counter.counted_from + counter.updates
    planned_updates = plan.total_updates if plan is not None else estimated_updates
    planned_examples = plan.examples_seen if plan is not None else None
    if planned_epochs is None and plan is not None:
        planned_epochs = plan.epochs_completed + int(plan.ends_mid_epoch)

    if counter.partial_window_count:
        flags.append(Flag("last_window_partial", _partial_windows_text(counter, plan) + "."))
    if counter.duplicates:
        detail = (
            f"DistributedSampler padding made the replicas train on {counter.duplicates:,}"
            " duplicated sample(s): those examples count twice in their epoch. Make the dataset"
            " size divisible by the replicas, or use a sampler with drop_last=True."
        )
        flags.append(Flag("padding_duplicates", detail))
    if counter.skipped_count:
        detail = (
            f"the GradScaler skipped {counter.skipped_count} optimizer step(s) (first: update"
            f" {counter.skipped_updates[0]}) that Lightning still counted in global_step and"
            " the LR scheduler."
        )
        flags.append(Flag("gradscaler_skipped", detail))
    if counter.k_changes:
        changes = ", ".join(f"{c.old} -> {c.new} from update {c.update}" for c in counter.k_changes)
        detail = (
            f"accumulate_grad_batches changed during the run ({changes}): the examples per"
            " update changed with it."
        )
        flags.append(Flag("k_changed", detail))
    spread = counter.token_spread
    if spread.ratio is not None and spread.ratio > token_spread_ratio:
        detail = (
            f"tokens per full update range from {spread.min:,} to {spread.max:,}"
            f" (x{spread.ratio:.2f}); a loss averaged per micro-batch weights each token"
            " differently across updates: normalise by the token count if the comparison"
            " needs it."
        )
        flags.append(Flag("tokens_spread", detail))
    if unstepped := counter.open_micro_batches:
        detail = f"{unstepped} micro-batch(es) after the last update were never stepped."
        flags.append(Flag("unstepped_micro_batches", detail))
    if plan is not None and estimated_updates not in (None, plan.total_updates):
        detail = (
            f"Lightning's estimated_stepping_batches is {estimated_updates:,} but the plan is"
            f" {plan.total_updates:,} updates"
            + (" (Lightning's estimate ignores a changing K)" if len(plan.k_schedule) > 1 else "")
            + ": a schedule sized from the estimate will not end where training ends."
        )
        flags.append(Flag("estimate_mismatch", detail))
    kept_planned, kept_done = {
        "updates": (planned_updates, updates_done),
        "examples": (planned_examples, counter.examples),
        "epochs": (planned_epochs, epochs_done),
    }[keep]
    missed = kept_planned is not None and kept_done is not None and kept_planned != kept_done
    if missed:
        short = kept_done < kept_planned  # type: ignore[operator]
        detail = f"the comparison keeps {keep}: planned {kept_planned:,}, done {kept_done:,}."
        flags.append(Flag("plan_shortfall" if short else "plan_exceeded", detail))
    per_window = ""
    if counter.extra_steps:
        windows = counter.updates - counter.extra_steps
        per_window = f"{counter.updates / windows:.3g} optimizer steps per batch window"
        detail = (
            f"{per_window} (a batch stepped several optimizers, as under manual optimization):"
            " updates_done counts every step, as global_step does; a row of updates.parquet,"
            " the examples per update and the tokens per full update are per batch window."
        )
        flags.append(Flag("note", detail))
    flags += [Flag("note", note) for note in notes]

    parts = [effective_batch_text(*astuple(config))]
    if planned_updates is None or planned_updates == updates_done:
        parts.append(f"{updates_done:,} updates")
    else:
        parts.append(f"{updates_done:,} of {planned_updates:,} planned updates")
    if per_window:
        parts[-1] += f" ({per_window})"
    examples = counter.examples
    parts.append("examples unknown" if examples is None else f"{examples:,} examples")
    tokens = counter.tokens if counter.tokens_source is not None else None
    if tokens is not None:
        parts.append(f"{tokens:,} tokens")
    if counter.partial_windows:
        first = counter.partial_windows[0]
        parts.append(last_window_text(first.micro_batches, first.accumulate_grad_batches))
    elif plan is not None or counter.updates:
        parts.append("last window full")
    if counter.duplicates:
        parts.append(f"{counter.duplicates:,} padding duplicate(s)")
    if counter.skipped_count:
        parts.append(f"{counter.skipped_count} step(s) skipped by the GradScaler")
    if missed:
        parts.append(f"keeps {keep}: {kept_done:,} of {kept_planned:,}")
    return Summary(
        **asdict(config),
        effective_batch_size=config.effective_batch_size,
        planned_updates=planned_updates,
        planned_examples=planned_examples,
        planned_epochs=planned_epochs,
        estimated_stepping_batches=estimated_updates,
        updates_done=updates_done + unsummed,
        examples_seen=None if unsummed else examples,
        tokens_seen=None if unsummed else tokens,
        tokens_source=counter.tokens_source,
        epochs_done=epochs_done,
        micro_batches=counter.micro_batches,
        padding_duplicates=counter.duplicates,
        partial_windows=counter.partial_window_count,
        skipped_updates=counter.skipped_count,
        k_changes=list(counter.k_changes),
        tokens_per_update=spread,
        keep=keep,
        kept_planned=kept_planned,
        kept_done=kept_done,
        flags=flags,
        line="; ".join(parts),
    )
