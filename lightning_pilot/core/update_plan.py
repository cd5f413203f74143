"""The effective-batch plan without Lightning or torch (docs/effective-batch.md):
:func:`plan_updates` predicts the micro-batches, examples and updates of a run."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from lightning_pilot.core import validate

Keep = Literal["updates", "examples", "epochs"]
#: What a comparison of runs may hold constant; the other quantities are recorded.
KEEP_CHOICES: Final[tuple[str, ...]] = get_args(Keep)

ReplicaSplit = Literal["pad", "drop"]
_REPLICA_SPLITS: Final[tuple[str, ...]] = get_args(ReplicaSplit)

#: How many partial windows, skipped steps and K changes a counter lists (it counts them all).
MAX_LISTED: Final = 20


def normalise_schedule(
    accumulate_grad_batches: int | Mapping[int, int], *, owner: str = "plan_updates"
) -> tuple[tuple[int, int], ...]:
    """``K`` or an ``{epoch: K}`` schedule as sorted ``(first_epoch, K)`` pairs, as Lightning's
    ``GradientAccumulationScheduler`` reads it (epochs before the first key: 1)."""
    name = "accumulate_grad_batches"
    if isinstance(accumulate_grad_batches, Mapping):
        if not accumulate_grad_batches:
            expected = "an integer >= 1 or a non-empty {epoch: K}"
            raise ValueError(validate.invalid(owner, name, accumulate_grad_batches, expected))
        pairs: dict[int, int] = {}
        for epoch, k in accumulate_grad_batches.items():
            first = validate.integer(owner, f"{name} epoch", epoch, minimum=0)
            pairs[first] = validate.integer(owner, f"{name}[{epoch!r}]", k, minimum=1)
        pairs.setdefault(0, 1)
        return tuple(sorted(pairs.items()))
    k = validate.integer(
        owner, name, accumulate_grad_batches, minimum=1, hint="or an {epoch: K} schedule"
    )
    return ((0, k),)


def _k_at(schedule: Sequence[tuple[int, int]], epoch: int) -> int:
    return next((k for first, k in reversed(schedule) if epoch >= first), 1)


@dataclass(frozen=True)
class UpdatePlan:
    """What a configuration will do, as Lightning trains it (docs/effective-batch.md; per-epoch
    figures use the first epoch's ``K``).

    Example:
        >>> plan = plan_updates(3200, 2, accumulate_grad_batches=8, epochs=1)
        >>> plan.describe()
        '16 examples per update (2 x 8 x 1 replica); 200 updates; 3,200 examples; last window full'
    """

    dataset_size: int
    micro_batch_size: int
    accumulate_grad_batches: int
    dp_replicas: int
    epochs: int | None
    max_steps: int | None
    drop_last: bool
    k_schedule: tuple[tuple[int, int], ...]
    examples_per_update: int
    samples_per_replica: int
    duplicates_per_epoch: int
    micro_batches_per_epoch: int
    examples_per_epoch: int
    updates_per_epoch: int
    last_window_micro_batches: int
    last_window_partial: bool
    last_window_weight: float
    total_updates: int
    examples_seen: int
    epochs_completed: int
    ends_mid_epoch: bool
    partial_windows: int
    padding_duplicates: int

    def describe(self) -> str:
        """One line for humans: the effective batch, the budget and the last window."""
        parts = [
            effective_batch_text(
                self.micro_batch_size, self.accumulate_grad_batches, self.dp_replicas
            ),
            f"{self.total_updates:,} updates",
            f"{self.examples_seen:,} examples",
            last_window_text(self.last_window_micro_batches, self.accumulate_grad_batches),
        ]
        if self.last_window_partial and self.partial_windows == 0:  # max_steps stops it first
            parts[-1] = "the partial last window of an epoch is never reached (max_steps)"
        if len(self.k_schedule) > 1:
            parts.append("K by epoch " + ", ".join(f"{e}: {k}" for e, k in self.k_schedule))
        if self.duplicates_per_epoch:
            parts.append(f"{self.duplicates_per_epoch:,} padding duplicate(s) per epoch")
        return "; ".join(parts)


#: The note of an update row whose tokens are null.
TOKENS_NOT_COUNTED: Final = (
    "tokens not counted: not every micro-batch had an attention mask or integer token ids"
    " to count them from"
)


def effective_batch_text(micro_batch_size: int | None, k: int | None, replicas: int | None) -> str:
    """``"16 examples per update (2 x 8 x 1 replica)"``; unknown factors read ``?``."""
    factors = [micro_batch_size, k, replicas]
    known = [f for f in factors if f is not None]
    total = f"{math.prod(known):,}" if len(known) == len(factors) else "?"
    shown = " x ".join("?" if f is None else str(f) for f in factors)
    noun = "replica" if replicas == 1 else "replicas"
    return f"{total} examples per update ({shown} {noun})"


def last_window_text(micro_batches: int, k: int) -> str:
    """``"last window full"`` or ``"last window partial (1 of 2 micro-batches, weight 0.50)"``."""
    if micro_batches in (0, k):
        return "last window full"
    return (
        f"last window partial ({micro_batches} of {k} micro-batches,"
        f" weight {micro_batches / k:.2f})"
    )


def plan_updates(
    dataset_size: int,
    micro_batch_size: int,
    accumulate_grad_batches: int | Mapping[int, int] = 1,
    dp_replicas: int = 1,
    epochs: int | None = None,
    max_steps: int | None = None,
    drop_last: bool = False,
    *,
    replica_split: ReplicaSplit = "pad",
    limit_micro_batches: int | None = None,
) -> UpdatePlan:
    """Plan the updates and examples of a training configuration, as Lightning runs it.

    Args:
        micro_batch_size: examples per micro-batch on one replica (the loader's ``batch_size``).
        accumulate_grad_batches: ``K``, or an ``{epoch: K}`` schedule (:func:`normalise_schedule`).
        dp_replicas: data-parallel replicas; tensor- or pipeline-parallel ranks that share one
            batch are not replicas.
        epochs, max_steps: Lightning's ``max_epochs`` and ``max_steps``; ``None``: no limit.
        drop_last: the loader drops each replica's incomplete last micro-batch.
        replica_split: how a ``DistributedSampler`` evens the replicas out: ``"pad"`` repeats
            samples (its default, ``drop_last=False``), ``"drop"`` leaves the tail out.
        limit_micro_batches: most micro-batches per replica per epoch (``limit_train_batches``,
            ``fast_dev_run``, ``overfit_batches``).

    Raises ``ValueError`` for a value out of range or no ``epochs`` nor ``max_steps``,
    ``TypeError`` for a wrong type.

    Example:
        >>> plan = plan_updates(3200, 2, accumulate_grad_batches=8, dp_replicas=1, epochs=1)
        >>> plan.examples_per_update, plan.updates_per_epoch, plan.total_updates
        (16, 200, 200)
        >>> plan.examples_seen, plan.last_window_micro_batches, plan.last_window_partial
        (3200, 8, False)
    """
    owner = "plan_updates"
    n = validate.integer(owner, "dataset_size", dataset_size, minimum=1)
    b = validate.integer(owner, "micro_batch_size", micro_batch_size, minimum=1)
    schedule = normalise_schedule(accumulate_grad_batches, owner=owner)
    replicas = validate.integer(owner, "dp_replicas", dp_replicas, minimum=1)
    n_epochs = validate.integer(owner, "epochs", epochs, minimum=1, optional=True)
    steps = validate.integer(owner, "max_steps", max_steps, minimum=0, optional=True)
    limit = validate.integer(
        owner, "limit_micro_batches", limit_micro_batches, minimum=0, optional=True
    )
    validate.boolean(owner, "drop_last", drop_last)
    validate.choice(owner, "replica_split", replica_split, _REPLICA_SPLITS)
    if n_epochs is None and steps is None:
        raise ValueError(
            f"{owner}(epochs=None, max_steps=None) is invalid: give epochs, max_steps or both"
            " (Lightning's max_epochs / max_steps)."
        )

    # One replica's share of an epoch, as DistributedSampler deals it out.
    if replica_split == "pad":
        per_replica = math.ceil(n / replicas)
        duplicates = per_replica * replicas - n
    else:
        per_replica, duplicates = n // replicas, 0
    natural = per_replica // b if drop_last else math.ceil(per_replica / b)
    micro_batches = natural if limit is None else min(natural, limit)
    # Only the last micro-batch of an undropped, unlimited share can be short.
    cut = drop_last or micro_batches < natural
    per_replica_examples = micro_batches * b if cut else per_replica
    # The padded samples are the last of each padded replica's share: seen only if that is.
    duplicates_seen = duplicates if per_replica_examples == per_replica else 0
    epoch_examples = per_replica_examples * replicas

    k0 = schedule[0][1]
    updates_per_epoch = math.ceil(micro_batches / k0)
    last_window = micro_batches - (updates_per_epoch - 1) * k0 if micro_batches else 0

    total = examples = dup_total = partial = epoch = 0
    ends_mid_epoch = False
    while micro_batches and (n_epochs is None or epoch < n_epochs):
        if steps is not None and total >= steps:
            break
        k = _k_at(schedule, epoch)
        updates = math.ceil(micro_batches / k)
        epoch_partial = int(micro_batches % k != 0)
        if steps is not None and total + updates > steps:
            # Stops inside this epoch: only full windows of full micro-batches are stepped.
            remaining = steps - total
            total += remaining
            examples += remaining * k * b * replicas
            ends_mid_epoch = remaining > 0
            break
        whole = 1
        if epoch >= schedule[-1][0]:  # K no longer changes: skip every whole epoch left
            left = math.inf if n_epochs is None else n_epochs - epoch
            if steps is not None:
                left = min(left, (steps - total) // updates)
            whole = int(left)
        total += whole * updates
        examples += whole * epoch_examples
        dup_total += whole * duplicates_seen
        partial += whole * epoch_partial
        epoch += whole

    return UpdatePlan(
        dataset_size=n,
        micro_batch_size=b,
        accumulate_grad_batches=k0,
        dp_replicas=replicas,
        epochs=n_epochs,
        max_steps=steps,
        drop_last=drop_last,
        k_schedule=schedule,
        examples_per_update=b * k0 * replicas,
        samples_per_replica=per_replica,
        duplicates_per_epoch=duplicates,
        micro_batches_per_epoch=micro_batches,
        examples_per_epoch=epoch_examples,
        updates_per_epoch=updates_per_epoch,
        last_window_micro_batches=last_window,
        last_window_partial=0 < last_window < k0,
        last_window_weight=last_window / k0 if micro_batches else 1.0,
        total_updates=total,
        examples_seen=examples,
        epochs_completed=epoch,
        ends_mid_epoch=ends_mid_epoch,
        partial_windows=partial,
        padding_duplicates=dup_total,
    )


def replica_duplicates(
    *,
    dataset_size: int,
    num_replicas: int,
    rank: int,
    samples_per_replica: int,
    batch_idx: int,
    micro_batch_size: int,
) -> int:
    """Duplicated samples a padding ``DistributedSampler`` put in one micro-batch of a rank (its
    last sample of the epoch, when that position is past the dataset)."""
    last_position = (samples_per_replica - 1) * num_replicas + rank
    if samples_per_replica < 1 or last_position < dataset_size:
        return 0
    last_batch = (samples_per_replica - 1) // micro_batch_size
    return 1 if batch_idx == last_batch else 0


def plan_for_fit(
    dataset_size: int | None, micro_batch_size: int | None, **budget: Any
) -> tuple[UpdatePlan | None, str | None]:
    """:func:`plan_updates` (``budget``: its other arguments) for a fit, or no plan and why
    (no note without a dataset or micro-batch size)."""
    if budget.get("epochs") is None and budget.get("max_steps") is None:
        return None, "neither max_epochs nor max_steps limits the run: no plan"
    if not dataset_size or not micro_batch_size:
        return None, None
    try:
        return plan_updates(dataset_size, micro_batch_size, **budget), None
    except (TypeError, ValueError) as err:  # e.g. max_epochs=0: nothing to plan
        return None, f"no plan: {err}"
