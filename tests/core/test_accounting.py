"""Effective-batch arithmetic and per-update counting, without a Trainer."""

from __future__ import annotations

import io
import itertools
import math
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_pilot.core.accounting import (
    BatchConfig,
    KChange,
    UpdateCounter,
    check_accumulation_windows,
    pack_counts,
    partial_window_remedy,
    summarize,
    unpack_sums,
)
from lightning_pilot.core.update_plan import (
    TOKENS_NOT_COUNTED,
    normalise_schedule,
    plan_for_fit,
    plan_updates,
    replica_duplicates,
)


def simulate(
    n: int,
    b: int,
    schedule: dict[int, int],
    replicas: int,
    epochs: int | None,
    max_steps: int | None,
    drop_last: bool = False,
    split: str = "pad",
    limit: int | None = None,
) -> dict[str, int]:
    """Walk sample by sample through what Lightning does (independent of the planner)."""
    indices = list(range(n))
    if replicas > 1 and split == "pad":
        total_size = math.ceil(n / replicas) * replicas
        indices += (indices * math.ceil(total_size / n))[: total_size - n]
    elif replicas > 1:
        indices = indices[: (n // replicas) * replicas]
    shares = [indices[r::replicas] for r in range(replicas)]
    updates = examples = duplicates = epoch = partial = 0
    while epochs is None or epoch < epochs:
        k = max(v for e, v in sorted(schedule.items()) if e <= epoch) if schedule else 1
        batches = [
            [share[i : i + b] for i in range(0, len(share), b)] for share in shares
        ]  # per replica
        if drop_last:
            batches = [[mb for mb in rb if len(mb) == b] for rb in batches]
        if limit is not None:
            batches = [rb[:limit] for rb in batches]
        count = len(batches[0])
        if count == 0:
            break
        window: list[int] = []
        for i in range(count):
            window.append(i)
            if len(window) == k or i == count - 1:
                partial += len(window) < k
                updates += 1
                for rb in batches:
                    for j in window:
                        examples += len(rb[j])
                for r, rb in enumerate(batches):
                    for j in window:
                        positions = [r + (j * b + t) * replicas for t in range(len(rb[j]))]
                        duplicates += sum(p >= n for p in positions)
                window = []
                if max_steps is not None and updates >= max_steps:
                    return {"updates": updates, "examples": examples, "dups": duplicates}
        epoch += 1
        if max_steps is not None and updates >= max_steps:
            break
    return {"updates": updates, "examples": examples, "dups": duplicates, "partial": partial}


# ---------------------------------------------------------------------------------------------
# plan_updates
# ---------------------------------------------------------------------------------------------


def test_the_seeds_example() -> None:
    plan = plan_updates(3200, 2, accumulate_grad_batches=8, dp_replicas=1, epochs=1)
    assert plan.examples_per_update == 16
    assert plan.updates_per_epoch == plan.total_updates == 200
    assert plan.examples_seen == 3200
    assert plan.last_window_micro_batches == 8
    assert not plan.last_window_partial
    assert plan.describe() == (
        "16 examples per update (2 x 8 x 1 replica); 200 updates; 3,200 examples; last window full"
    )


def test_what_the_comparison_keeps() -> None:
    control = plan_updates(3200, 2, accumulate_grad_batches=8, epochs=1)
    # Keep the 200 updates, double the micro-batch: twice the examples (two epochs).
    same_updates = plan_updates(3200, 4, accumulate_grad_batches=8, max_steps=200)
    assert (same_updates.total_updates, same_updates.examples_seen) == (200, 6400)
    assert same_updates.epochs_completed == 2
    # Keep one epoch, double the micro-batch: half the updates, same examples.
    same_epochs = plan_updates(3200, 4, accumulate_grad_batches=8, epochs=1)
    assert (same_epochs.total_updates, same_epochs.examples_seen) == (100, control.examples_seen)


def test_replicas_multiply_the_effective_batch() -> None:
    one = plan_updates(3200, 2, accumulate_grad_batches=8, dp_replicas=1, epochs=1)
    four = plan_updates(3200, 2, accumulate_grad_batches=8, dp_replicas=4, epochs=1)
    assert four.examples_per_update == 4 * one.examples_per_update == 64
    assert four.total_updates == 50
    assert four.examples_seen == 3200
    assert four.describe().startswith("64 examples per update (2 x 8 x 4 replicas)")


def test_partial_last_window_is_down_weighted() -> None:
    plan = plan_updates(5, 1, accumulate_grad_batches=2, epochs=1)
    assert (plan.total_updates, plan.last_window_micro_batches) == (3, 1)
    assert plan.last_window_partial
    assert plan.last_window_weight == 0.5
    assert plan.partial_windows == 1
    assert "last window partial (1 of 2 micro-batches, weight 0.50)" in plan.describe()


def test_padding_duplicates_of_a_distributed_sampler() -> None:
    plan = plan_updates(21, 2, accumulate_grad_batches=2, dp_replicas=2, epochs=3)
    assert plan.samples_per_replica == 11
    assert plan.duplicates_per_epoch == 1
    assert plan.micro_batches_per_epoch == 6
    assert plan.examples_per_epoch == 22
    assert (plan.total_updates, plan.examples_seen, plan.padding_duplicates) == (9, 66, 3)
    assert "1 padding duplicate(s) per epoch" in plan.describe()
    dropped = plan_updates(21, 2, 2, 2, epochs=1, replica_split="drop")
    assert (dropped.samples_per_replica, dropped.examples_seen, dropped.duplicates_per_epoch) == (
        10,
        20,
        0,
    )


def test_max_steps_stops_inside_an_epoch() -> None:
    plan = plan_updates(20, 2, accumulate_grad_batches=2, max_steps=7)
    assert (plan.total_updates, plan.examples_seen) == (7, 28)
    assert (plan.epochs_completed, plan.ends_mid_epoch) == (1, True)


def test_fast_dev_run_limits_micro_batches() -> None:
    # fast_dev_run=3 with K=2: max_steps=3, 3 micro-batches per epoch, one epoch -> 2 updates.
    plan = plan_updates(64, 2, 2, epochs=1, max_steps=3, limit_micro_batches=3)
    assert (plan.total_updates, plan.examples_seen, plan.last_window_micro_batches) == (2, 6, 1)


def test_a_schedule_of_k() -> None:
    plan = plan_updates(20, 2, {1: 2}, epochs=3)
    assert plan.k_schedule == ((0, 1), (1, 2))
    assert plan.accumulate_grad_batches == 1
    assert plan.total_updates == 10 + 5 + 5
    assert "K by epoch 0: 1, 1: 2" in plan.describe()


def test_a_huge_step_budget_is_planned_without_walking_every_epoch() -> None:
    plan = plan_updates(20, 2, {2: 2}, max_steps=10**12)
    assert plan.total_updates == 10**12
    # 2 epochs of 10 updates at K=1, then 5 updates (20 examples) per epoch at K=2.
    assert plan.examples_seen == 40 + (10**12 - 20) // 5 * 20


@pytest.mark.parametrize(
    ("n", "b", "schedule", "replicas", "epochs", "max_steps", "drop_last", "split", "limit"),
    [
        (n, b, s, r, e, m, d, sp, lim)
        for n, b, s, r, (e, m), d, sp, lim in itertools.product(
            (1, 7, 21, 32),
            (1, 3),
            ({0: 1}, {0: 4}, {0: 2, 2: 3}),
            (1, 2, 3),
            ((1, None), (3, None), (None, 5), (2, 7)),
            (False, True),
            ("pad", "drop"),
            (None, 2),
        )
        if not (r == 1 and sp == "drop")
    ],
)
def test_plan_matches_a_sample_by_sample_simulation(
    n: int,
    b: int,
    schedule: dict[int, int],
    replicas: int,
    epochs: int | None,
    max_steps: int | None,
    drop_last: bool,
    split: Any,
    limit: int | None,
) -> None:
    plan = plan_updates(
        n,
        b,
        schedule,
        replicas,
        epochs,
        max_steps,
        drop_last,
        replica_split=split,
        limit_micro_batches=limit,
    )
    walked = simulate(n, b, schedule, replicas, epochs, max_steps, drop_last, split, limit)
    assert plan.total_updates == walked["updates"]
    assert plan.examples_seen == walked["examples"]
    assert plan.padding_duplicates == walked["dups"]
    if "partial" in walked:
        assert plan.partial_windows == walked["partial"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dataset_size": 0}, ValueError, r"plan_updates\(dataset_size=0\).*an integer >= 1"),
        ({"dataset_size": 3.5}, TypeError, r"dataset_size=3.5"),
        ({"micro_batch_size": True}, TypeError, r"micro_batch_size=True"),
        ({"accumulate_grad_batches": 0}, ValueError, r"accumulate_grad_batches=0"),
        ({"accumulate_grad_batches": "8"}, TypeError, r"accumulate_grad_batches='8'.*schedule"),
        ({"accumulate_grad_batches": {}}, ValueError, r"non-empty"),
        ({"accumulate_grad_batches": {-1: 2}}, ValueError, r"epoch=-1"),
        ({"accumulate_grad_batches": {0: 0}}, ValueError, r"accumulate_grad_batches\[0\]=0"),
        ({"dp_replicas": 0}, ValueError, r"dp_replicas=0"),
        ({"epochs": 0}, ValueError, r"epochs=0"),
        ({"epochs": None, "max_steps": None}, ValueError, r"give epochs, max_steps or both"),
        ({"max_steps": -1}, ValueError, r"max_steps=-1.*an integer >= 0 or None"),
        ({"drop_last": 1}, TypeError, r"drop_last=1.*True or False"),
        ({"replica_split": "even"}, ValueError, r"replica_split='even'.*one of 'pad', 'drop'"),
        ({"replica_split": None}, TypeError, r"replica_split=None.*one of 'pad', 'drop'"),
        ({"dataset_size": 10**400}, ValueError, r"dataset_size=1000.*64 bits"),
        ({"accumulate_grad_batches": {"0": 2}}, TypeError, r"accumulate_grad_batches epoch='0'"),
        ({"limit_micro_batches": -2}, ValueError, r"limit_micro_batches=-2"),
    ],
)
def test_bad_arguments_name_themselves(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    arguments: dict[str, Any] = {"dataset_size": 100, "micro_batch_size": 2, "epochs": 1}
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        plan_updates(**arguments)


def test_schedule_normalisation() -> None:
    assert normalise_schedule({3: 4, 1: 2}) == ((0, 1), (1, 2), (3, 4))
    assert normalise_schedule({0: 5}) == ((0, 5),)


# ---------------------------------------------------------------------------------------------
# replica_duplicates against torch's DistributedSampler
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 5, 9, 21, 24])
@pytest.mark.parametrize("b", [1, 2, 3])
def test_duplicates_match_torch_distributed_sampler(replicas: int, n: int, b: int) -> None:
    padded = list(range(n)) * (replicas + 1)
    for rank in range(replicas):
        sampler = DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=False)
        share = list(sampler)
        # The rank's k-th sample is position rank + k * replicas of the padded list.
        assert share == [padded[rank + k * replicas] for k in range(len(share))]
        expected = sum(rank + k * replicas >= n for k in range(len(share)))
        counted = sum(
            replica_duplicates(
                dataset_size=n,
                num_replicas=replicas,
                rank=rank,
                samples_per_replica=sampler.num_samples,
                batch_idx=i,
                micro_batch_size=b,
            )
            for i in range(math.ceil(len(share) / b))
        )
        assert counted == expected


# ---------------------------------------------------------------------------------------------
# UpdateCounter and summarize
# ---------------------------------------------------------------------------------------------


def count(
    counter: UpdateCounter,
    windows: list[tuple[int, int]],
    *,
    examples: int = 2,
    tokens: list[int] | None = None,
    skipped: tuple[int, ...] = (),
    epoch: int = 0,
) -> None:
    """Feed windows of (micro-batches, K) through the counter and absorb them."""
    batch = 0
    for index, (micro_batches, k) in enumerate(windows):
        for _ in range(micro_batches):
            counter.add_micro_batch(
                epoch=epoch,
                batch_idx=batch,
                examples=examples,
                tokens=None if tokens is None else tokens[index] // micro_batches,
                tokens_source=None if tokens is None else "attention_mask",
            )
            batch += 1
        update = counter.counted_from + counter.updates + len(counter.pending) + 1
        counter.close_update(
            update=update, accumulate_grad_batches=k, stepped=update not in skipped
        )
    counter.absorb(UpdateCounter.local_as_all_ranks(counter.take_pending()))


def test_counter_rows_and_totals() -> None:
    counter = UpdateCounter()
    count(counter, [(2, 2), (2, 2), (1, 2)], tokens=[40, 60, 10])
    assert counter.updates == 3
    assert counter.micro_batches == 5
    assert counter.examples == 10
    assert counter.tokens == 110
    assert counter.partial_window_count == 1
    assert counter.partial_windows[0].weight == 0.5
    # The spread is over full windows only: 40 and 60 tokens.
    assert counter.token_spread.ratio == 1.5
    assert counter.token_spread.min == 40


def test_counter_rows_carry_the_window() -> None:
    counter = UpdateCounter()
    for i in range(3):
        counter.add_micro_batch(epoch=1, batch_idx=10 + i, examples=4, tokens=7, duplicates=0)
    assert counter.open_micro_batches == 3
    counter.close_update(update=5, accumulate_grad_batches=4, stepped=False)
    [row] = counter.take_pending()
    assert row == {
        "update": 5,
        "epoch": 1,
        "batch_idx_first": 10,
        "batch_idx_last": 12,
        "accumulate_grad_batches": 4,
        "micro_batches": 3,
        "examples": 12,
        "tokens": None,  # no tokens_source given: tokens of unknown origin are not kept
        "tokens_source": None,
        "padding_duplicates": 0,
        "window_partial": True,
        "weight": 0.75,
        "optimizer_stepped": False,
        "notes": TOKENS_NOT_COUNTED,  # a null count says why
    }
    assert counter.open_micro_batches == 0


def test_unreadable_values_make_totals_null_not_zero() -> None:
    counter = UpdateCounter()
    counter.add_micro_batch(epoch=0, batch_idx=0, examples=None, tokens=None)
    counter.close_update(update=1, accumulate_grad_batches=1)
    counter.absorb(UpdateCounter.local_as_all_ranks(counter.take_pending()))
    assert counter.examples is None
    result = summarize(
        counter=counter, config=BatchConfig(None, 1, 1), plan=None, keep="examples", epochs_done=1
    )
    assert result.examples_seen is None
    assert result.tokens_seen is None
    assert result.kept_done is None
    assert "examples unknown" in result.line


def test_state_round_trip_continues_the_counts() -> None:
    first = UpdateCounter()
    count(first, [(2, 2), (2, 2)], tokens=[40, 44], skipped=(2,))
    state = first.state_dict()
    # Weights-only-safe: only plain types.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=True)
    second = UpdateCounter()
    second.load_state_dict(restored)
    count(second, [(4, 4), (1, 4)], tokens=[48, 10])
    assert second.updates == 4
    assert second.micro_batches == 9
    assert second.tokens == 40 + 44 + 48 + 10
    assert second.skipped_count == 1
    assert second.skipped_updates == [2]
    assert second.k_changes == [KChange(update=3, old=2, new=4)]
    assert second.partial_window_count == 1
    assert second.token_spread.max == 48


def test_old_or_partial_state_loads_with_defaults() -> None:
    counter = UpdateCounter()
    counter.load_state_dict({"updates": 3})
    assert (counter.updates, counter.examples, counter.skipped_count) == (3, 0, 0)


def test_start_late_makes_earlier_examples_unknown() -> None:
    counter = UpdateCounter()
    note = counter.resume_at(7)
    assert note is not None
    assert note.startswith("resumed at update 7 from a checkpoint without accountant counts")
    count(counter, [(1, 1)])
    result = summarize(
        counter=counter, config=BatchConfig(2, 1, 1), plan=None, keep="updates", epochs_done=1
    )
    assert result.updates_done == 8
    assert result.examples_seen is None
    assert counter.resume_at(8) is None  # the counts line up
    assert counter.resume_at(9) == (
        "the checkpoint's counts cover 8 updates but training resumed at update 9"
    )


def _window(counter: UpdateCounter, batch_idx: int, update: int) -> None:
    """One micro-batch of 4 examples and 10 tokens that the module stepped at ``update``."""
    counter.add_micro_batch(
        epoch=0, batch_idx=batch_idx, examples=4, tokens=10, tokens_source="attention_mask"
    )
    counter.close_update(update=update, accumulate_grad_batches=None)
    counter.absorb(UpdateCounter.local_as_all_ranks(counter.take_pending()))


def test_a_window_feeding_several_optimizer_steps_counts_every_step() -> None:
    """A batch that steps two optimizers advances global_step by 2: one window, its examples
    and tokens counted once, two updates."""
    counter = UpdateCounter()
    for batch in range(3):
        counter.add_micro_batch(
            epoch=0, batch_idx=batch, examples=4, tokens=10, tokens_source="attention_mask"
        )
        counter.close_update(update=2 * batch + 2, accumulate_grad_batches=None)
    rows = counter.take_pending()
    assert [(r["update"], r["micro_batches"], r["examples"], r["weight"]) for r in rows] == [
        (2, 1, 4, 1.0),
        (4, 1, 4, 1.0),
        (6, 1, 4, 1.0),
    ]
    counter.absorb(UpdateCounter.local_as_all_ranks(rows))
    assert (counter.updates, counter.extra_steps, counter.micro_batches) == (6, 3, 3)
    assert (counter.examples, counter.tokens, counter.token_spread.updates) == (12, 30, 3)
    result = summarize(
        counter=counter, config=BatchConfig(4, 1, 1), plan=None, keep="updates", epochs_done=1
    )
    assert result.updates_done == 6
    assert result.line == (
        "4 examples per update (4 x 1 x 1 replica); 6 updates (2 optimizer steps per batch"
        " window); 12 examples; 30 tokens; last window full"
    )
    assert [flag.flag for flag in result.flags] == ["note"]
    assert result.flags[0].detail == (
        "2 optimizer steps per batch window (a batch stepped several optimizers, as under manual"
        " optimization): updates_done counts every step, as global_step does; a row of"
        " updates.parquet, the examples per update and the tokens per full update are per batch"
        " window."
    )

    # The counts travel in the checkpoint and line up with the global_step resumed at.
    resumed = UpdateCounter()
    resumed.load_state_dict(counter.state_dict())
    assert resumed.resume_at(6) is None
    _window(resumed, 3, 8)
    assert (resumed.updates, resumed.extra_steps, resumed.examples) == (8, 4, 16)
    assert resumed.resume_at(8) is None

    # Resumed from a checkpoint without counts: the steps count from the resume.
    late = UpdateCounter()
    assert late.resume_at(6) is not None
    _window(late, 3, 8)
    _window(late, 4, 9)  # a batch that stepped one optimizer
    result = summarize(
        counter=late, config=BatchConfig(4, 1, 1), plan=None, keep="updates", epochs_done=1
    )
    assert (late.updates, late.extra_steps, result.updates_done) == (3, 1, 9)
    assert "9 updates (1.5 optimizer steps per batch window)" in result.line


def test_summarize_names_every_finding() -> None:
    counter = UpdateCounter()
    count(counter, [(2, 2), (2, 2), (2, 4), (1, 4)], tokens=[20, 90, 60, 5], skipped=(2,))
    counter.add_micro_batch(epoch=0, batch_idx=99, examples=2, tokens=None)
    counter.duplicates = 3
    plan = plan_updates(100, 2, accumulate_grad_batches=2, epochs=1)
    result = summarize(
        counter=counter,
        config=BatchConfig(2, 2, 1),
        plan=plan,
        keep="updates",
        epochs_done=1,
        estimated_updates=40,
        notes=["something to know"],
    )
    flags = {flag.flag: flag.detail for flag in result.flags}
    assert set(flags) == {
        "last_window_partial",
        "padding_duplicates",
        "gradscaler_skipped",
        "k_changed",
        "tokens_spread",
        "unstepped_micro_batches",
        "estimate_mismatch",
        "plan_shortfall",
        "note",
    }
    assert "2 of 4 update(s) stepped an incomplete" in flags["last_window_partial"]
    assert "weight 0.25, 0.50 of a full update" in flags["last_window_partial"]
    assert "train on 3 duplicated sample(s)" in flags["padding_duplicates"]
    assert "skipped 1 optimizer step(s) (first: update 2)" in flags["gradscaler_skipped"]
    assert "2 -> 4 from update 3" in flags["k_changed"]
    assert "from 20 to 90 (x4.50)" in flags["tokens_spread"]
    assert "planned 25, done 4" in flags["plan_shortfall"]
    assert result.line == (
        "4 examples per update (2 x 2 x 1 replica); 4 of 25 planned updates; 14 examples;"
        " 175 tokens; last window partial (2 of 4 micro-batches, weight 0.50);"
        " 3 padding duplicate(s); 1 step(s) skipped by the GradScaler; keeps updates: 4 of 25"
    )


@pytest.mark.parametrize(
    ("keep", "planned", "done"),
    [("updates", 3, 3), ("examples", 5, 5), ("epochs", 1, 1)],
)
def test_keep_selects_the_checked_quantity(keep: Any, planned: int, done: int) -> None:
    counter = UpdateCounter()
    count(counter, [(2, 2), (2, 2), (1, 2)], examples=1)
    plan = plan_updates(5, 1, accumulate_grad_batches=2, epochs=1)
    result = summarize(
        counter=counter, config=BatchConfig(1, 2, 1), plan=plan, keep=keep, epochs_done=1
    )
    assert (result.keep, result.kept_planned, result.kept_done) == (keep, planned, done)
    assert [flag.flag for flag in result.flags] == ["last_window_partial"]


# ---------------------------------------------------------------------------------------------
# Partial accumulation windows: the verdict and a remedy that fits the cause
# ---------------------------------------------------------------------------------------------


def test_epoch_length_not_a_multiple_of_k_gets_its_own_remedy() -> None:
    # 256 examples in batches of 4: 64 micro-batches, none partial; K=5 leaves 4 in the last.
    plan = plan_updates(256, 4, accumulate_grad_batches=5, epochs=2)
    assert (plan.micro_batches_per_epoch, plan.last_window_micro_batches) == (64, 4)
    remedy = partial_window_remedy(plan, 5)
    assert remedy == (
        "micro-batches per epoch (64) are not a multiple of accumulate_grad_batches (5): choose"
        " K dividing 64 (e.g. 4 or 8), or limit_train_batches to a multiple of K, or accept"
        " that each epoch's last update sees 4/5 of the examples"
    )
    assert "drop_last" not in remedy


def test_a_partial_last_micro_batch_that_drop_last_fixes() -> None:
    # 81 examples in batches of 2: 41 micro-batches, the last of 1 example; 40 fill K=5.
    plan = plan_updates(81, 2, accumulate_grad_batches=5, epochs=1)
    remedy = partial_window_remedy(plan, 5)
    assert remedy.startswith("the loader's last micro-batch is partial (81 examples per")
    assert remedy.endswith("use drop_last=True")


def test_a_partial_window_the_epoch_length_does_not_explain() -> None:
    # 65 micro-batches fill K=5: a partial window came from elsewhere (a mid-window resume).
    plan = plan_updates(129, 2, accumulate_grad_batches=5, epochs=1)
    remedy = partial_window_remedy(plan, 5)
    assert remedy.startswith("micro-batches per epoch (65) are a multiple of K (5), so the")
    assert "a resume from a checkpoint saved inside a window" in remedy


def test_a_partial_last_micro_batch_that_drop_last_does_not_fix() -> None:
    # 127 examples in batches of 2: 64 micro-batches; dropping the last leaves 63, still not 5k.
    plan = plan_updates(127, 2, accumulate_grad_batches=5, epochs=1)
    remedy = partial_window_remedy(plan, 5)
    assert remedy.startswith("micro-batches per epoch (64) are not a multiple")
    assert remedy.endswith("(drop_last=True alone leaves 63, not a multiple of 5 either)")


def test_limit_train_batches_and_a_prime_epoch_length() -> None:
    plan = plan_updates(1000, 1, accumulate_grad_batches=4, epochs=1, limit_micro_batches=67)
    remedy = partial_window_remedy(plan, 4)
    assert "choose K dividing 67 (e.g. 67)" in remedy
    assert "sees 3/4 of the examples" in remedy


def test_without_a_plan_the_window_names_its_epoch_length() -> None:
    remedy = partial_window_remedy(None, 5, batch_idx_last=63)
    assert remedy.startswith("micro-batches per epoch (64) are not a multiple")
    assert remedy.endswith("(no plan: counted in its epoch)")
    # A window that ends at a multiple of K was cut short by something else (a resume).
    assert partial_window_remedy(None, 5, 9).startswith("the partial window did not come")
    assert partial_window_remedy(None, 5).startswith("the partial window did not come")


def test_check_accumulation_windows_verdicts() -> None:
    counter = UpdateCounter()
    count(counter, [(5, 5)] * 12 + [(4, 5)])
    check = check_accumulation_windows(counter, plan_updates(64, 1, 5, epochs=1))
    assert check is not None
    assert (check.name, check.verdict) == ("partial_accumulation_windows", "warn")
    assert check.detail.startswith(
        "1 of 13 update(s) stepped an incomplete accumulation window (first: update 13, 4 of 5"
        " micro-batches); Lightning still divides the loss by K, so their examples got weight"
        " 0.80 of a full update; micro-batches per epoch (64) are not a multiple of"
    )
    assert counter.partial_windows[0].batch_idx_last == 63

    full = UpdateCounter()
    count(full, [(4, 4)] * 3)
    check = check_accumulation_windows(full)
    assert check is not None
    assert (check.verdict, check.detail) == (
        "pass",
        "all 3 update(s) counted stepped full windows of K=4 micro-batches",
    )
    single = UpdateCounter()
    count(single, [(1, 1)] * 3)
    assert check_accumulation_windows(single) is None  # K=1: nothing to check
    assert check_accumulation_windows(UpdateCounter()) is None


def test_effective_batch_size_needs_the_micro_batch() -> None:
    assert BatchConfig(2, 8, 4).effective_batch_size == 64
    assert BatchConfig(None, 8, 4).effective_batch_size is None


# ---------------------------------------------------------------------------------------------
# Summing rows over ranks
# ---------------------------------------------------------------------------------------------


def rank_rows(examples: list[int | None], tokens: list[int | None]) -> list[dict[str, Any]]:
    return [
        {"update": i + 1, "micro_batches": 2, "examples": e, "tokens": t, "padding_duplicates": 0}
        for i, (e, t) in enumerate(zip(examples, tokens, strict=True))
    ]


def all_reduce(*ranks: list[dict[str, Any]]) -> list[list[int]]:
    """What a sum all-reduce of every rank's packed tensor returns (torch does the adding)."""
    longest = max(len(rows) for rows in ranks)
    packed = torch.stack([torch.tensor(pack_counts(rows, longest)) for rows in ranks])
    summed: list[list[int]] = packed.sum(dim=0).tolist()
    return summed


def test_pack_counts_layout() -> None:
    row = {"micro_batches": 2, "examples": 4, "tokens": None, "padding_duplicates": 0}
    assert pack_counts([row], 2) == [[1, 2, 1, 4, 1, 0, 0, 0, 1], [0] * 9]


def test_two_data_replicas_sum_their_counts() -> None:
    rank0 = rank_rows([4, 4], [30, 31])
    rank1 = rank_rows([4, 3], [28, None])
    sums = all_reduce(rank0, rank1)
    filled = unpack_sums(rank0, sums, world_size=2, dp_replicas=2)
    assert [row["examples_all_ranks"] for row in filled] == [8, 7]
    assert [row["micro_batches_all_ranks"] for row in filled] == [4, 4]
    # Rank 1 could not read update 2's tokens: the sum is unknown, not 31.
    assert [row["tokens_all_ranks"] for row in filled] == [58, None]
    assert filled[0]["examples"] == 4  # the local count stays


def test_tensor_parallel_ranks_are_not_replicas() -> None:
    # 2 data replicas x 2 tensor-parallel ranks: both ranks of a group read the same batch.
    group_a, group_b = rank_rows([4], [30]), rank_rows([3], [20])
    sums = all_reduce(group_a, group_a, group_b, group_b)
    [row] = unpack_sums(group_a, sums, world_size=4, dp_replicas=2)
    assert (row["examples_all_ranks"], row["tokens_all_ranks"]) == (7, 50)


def test_a_rank_missing_an_update_makes_its_sums_unknown() -> None:
    rank0, rank1 = rank_rows([4, 4], [1, 1]), rank_rows([4], [1])
    sums = all_reduce(rank0, rank1)
    filled = unpack_sums(rank0, sums, world_size=2, dp_replicas=2)
    assert filled[0]["examples_all_ranks"] == 8
    assert filled[1]["examples_all_ranks"] is None
    assert filled[1]["notes"] == "only 1 of 2 ranks counted this update"


def test_an_uneven_world_is_not_divided() -> None:
    rows = rank_rows([4], [1])
    sums = all_reduce(rows, rows, rows)
    [row] = unpack_sums(rows, sums, world_size=3, dp_replicas=2)
    assert row["examples_all_ranks"] is None
    assert row["notes"] == "world size 3 is not a multiple of 2 replicas"


# ---------------------------------------------------------------------------------------------
# Lazy token counts, the fit's plan, the summary's plain form
# ---------------------------------------------------------------------------------------------


def test_token_counts_on_the_device_are_read_once_per_take() -> None:
    counter = UpdateCounter()
    calls: list[list[Any]] = []

    def read(values: list[Any]) -> list[float]:
        calls.append(values)
        return [float(v) for v in values]

    for i, tokens in enumerate([torch.tensor(3), 4, torch.tensor(5), torch.tensor(6)]):
        counter.add_micro_batch(
            epoch=0, batch_idx=i, examples=1, tokens=tokens, tokens_source="attention_mask"
        )
        if i % 2:
            counter.close_update(update=i // 2 + 1, accumulate_grad_batches=2)
    rows = counter.take_pending(read)
    assert [row["tokens"] for row in rows] == [7, 11]
    assert len(calls) == 1
    assert [int(v) for v in calls[0]] == [3, 5, 6]  # the int was never sent to be read
    assert counter.take_pending(read) == []


def test_a_micro_batch_without_tokens_makes_its_update_null() -> None:
    counter = UpdateCounter()
    counter.add_micro_batch(epoch=0, batch_idx=0, examples=1, tokens=torch.tensor(3))
    counter.add_micro_batch(epoch=0, batch_idx=1, examples=1, tokens=None)
    counter.close_update(update=1, accumulate_grad_batches=2)
    [row] = counter.take_pending()
    assert (row["tokens"], row["notes"]) == (None, TOKENS_NOT_COUNTED)


def test_state_keeps_the_checkpoint_format() -> None:
    counter = UpdateCounter()
    count(counter, [(2, 2), (1, 2)], tokens=[40, 10])
    state = counter.state_dict()
    assert list(state) == [
        "version",
        "updates",
        "micro_batches",
        "examples",
        "tokens",
        "tokens_source",
        "duplicates",
        "partial_window_count",
        "partial_windows",
        "skipped_count",
        "skipped_updates",
        "k_changes",
        "last_k",
        "last_update",
        "counted_from",
        "extra_steps",
        "token_stats",
    ]
    assert state["partial_windows"] == [
        {
            "update": 2,
            "epoch": 0,
            "batch_idx_last": 2,
            "micro_batches": 1,
            "accumulate_grad_batches": 2,
            "weight": 0.5,
            "examples": 2,
        }
    ]
    assert state["token_stats"] == [1, 40, 40, 40.0, 1600.0]


def test_plan_for_fit_says_why_there_is_no_plan() -> None:
    assert plan_for_fit(None, 2, epochs=1) == (None, None)
    assert plan_for_fit(10, None, epochs=1) == (None, None)
    assert plan_for_fit(10, 2, epochs=None, max_steps=None)[1] == (
        "neither max_epochs nor max_steps limits the run: no plan"
    )
    plan, note = plan_for_fit(10, 2, epochs=0)
    assert plan is None
    assert note is not None
    assert note.startswith("no plan: plan_updates(epochs=0) is invalid")
    plan, note = plan_for_fit(10, 2, accumulate_grad_batches={0: 2}, epochs=1, drop_last=True)
    assert (plan is not None, note) == (True, None)


def test_summary_as_dict_and_ledger_fields() -> None:
    counter = UpdateCounter()
    count(counter, [(2, 2), (1, 2)], tokens=[40, 10])
    result = summarize(
        counter=counter,
        config=BatchConfig(2, 2, 1),
        plan=plan_updates(6, 2, 2, epochs=1),
        keep="updates",
        epochs_done=1,
        unsummed=1,
    )
    plain = result.as_dict()
    assert plain["flags"][0]["flag"] == "last_window_partial"
    assert plain["tokens_per_update"] == {
        "updates": 1,
        "min": 40,
        "max": 40,
        "ratio": 1.0,
        "cv": None,
    }
    # An update never summed over the ranks counts as done; examples and tokens are unknown.
    assert result.ledger_fields() == {
        "micro_batch_size": 2,
        "accumulate_grad_batches": 2,
        "dp_replicas": 1,
        "effective_batch_size": 4,
        "planned_updates": 2,
        "updates_done": 3,
        "examples_seen": None,
        "tokens_seen": None,
    }
