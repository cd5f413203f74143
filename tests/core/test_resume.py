"""lightning_pilot.core.resume without a Trainer: RNG states, digests, values, trajectories."""

from __future__ import annotations

import math
import pickle
import random
from collections import OrderedDict
from pathlib import PurePosixPath
from typing import Any

import numpy as np
import pytest
import torch

from lightning_pilot.core.resume import (
    CONTENT_KEY_PREFIX,
    StepRecord,
    capture_rng,
    compare_trajectories,
    content_keys,
    count_tensors,
    dataset_fingerprint,
    digest,
    json_id,
    outputs_close,
    plain_values,
    restore_rng,
    rng_of_this_rank,
    unsafe_values,
)


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_rng_states_restore_every_generator_and_load_weights_only(tmp_path: Any) -> None:
    state = capture_rng()
    first = _draws()
    restore_rng(state)
    assert _draws() == first
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    restore_rng(torch.load(path, weights_only=True))
    assert _draws() == first
    assert unsafe_values(state) == []


def test_restore_leaves_missing_parts_alone() -> None:
    state = capture_rng()
    restore_rng({"python": state["python"]})
    first = random.random()
    restore_rng({"python": state["python"]})
    assert random.random() == first


def test_rng_of_this_rank_without_a_process_group_takes_the_shared_states() -> None:
    assert rng_of_this_rank({"rng": {"torch": 1}, "rng_by_rank": [{"torch": 2}]}) == {"torch": 1}
    assert rng_of_this_rank({"rng": "not a mapping"}) is None
    assert rng_of_this_rank({}) is None


def test_digest_tells_values_apart_by_type_shape_and_bytes() -> None:
    base = digest({"w": torch.zeros(2, 3), "n": 1})
    assert base == digest({"n": 1, "w": torch.zeros(2, 3)})  # key order does not matter
    assert len(base) == 16
    assert base != digest({"w": torch.zeros(3, 2), "n": 1})
    assert base != digest({"w": torch.zeros(2, 3, dtype=torch.float64), "n": 1})
    assert base != digest({"w": torch.ones(2, 3), "n": 1})
    assert digest([1, 2]) == digest((1, 2))
    assert digest(torch.zeros(0)) == digest(torch.zeros(0))


def test_json_id_keeps_scalars_and_names_the_rest() -> None:
    assert [json_id(v) for v in (1, 1.5, "a", True, None)] == [1, 1.5, "a", True, None]
    assert json_id(torch.tensor(3)) == "tensor(3)"


def test_content_keys_follow_the_inputs() -> None:
    keys = content_keys(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert keys is not None
    assert all(k.startswith(CONTENT_KEY_PREFIX) for k in keys)
    assert keys == content_keys(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert content_keys(torch.tensor(1.0)) is None
    assert content_keys(torch.zeros(0, 2)) is None
    assert content_keys([[1, 2]]) is None


def test_content_keys_of_pairs_use_every_input() -> None:
    # CLIP-style pairs: one caption shared by two images are two examples, and the same pair
    # gives the same key; an adapter's example_inputs gives such a mapping.
    from lightning_pilot.core.batches import BatchAdapter

    batch = {
        "input_ids": torch.tensor([[5, 6], [5, 6], [7, 8]]),
        "pixel_values": torch.stack(
            [torch.zeros(3, 2, 2), torch.ones(3, 2, 2), torch.zeros(3, 2, 2)]
        ),
        "attention_mask": torch.ones(3, 2, dtype=torch.long),
    }
    keys = content_keys(BatchAdapter().example_inputs(batch))
    assert keys is not None
    assert len(set(keys)) == 3
    assert keys == content_keys(BatchAdapter().example_inputs(dict(batch)))
    assert content_keys(batch["input_ids"])[0] == content_keys(batch["input_ids"])[1]
    assert (
        content_keys({"a": torch.zeros(2, 1), "b": torch.zeros(3, 1)}) is None
    )  # row counts differ


def test_dataset_fingerprint_reads_with_a_fixed_seed_and_restores_the_callers_rng() -> None:
    class Augmented:
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.rand(2) + index

    state = capture_rng()
    expected = _draws()
    restore_rng(state)
    assert dataset_fingerprint(Augmented()) == dataset_fingerprint(Augmented())
    restore_rng(state)
    dataset_fingerprint(Augmented())
    assert _draws() == expected


@pytest.mark.parametrize(
    "dataset",
    [iter([1, 2]), [object()], pytest.param("raises", id="raises")],
)
def test_dataset_fingerprint_is_none_when_the_items_cannot_be_compared(dataset: Any) -> None:
    class Raises:
        def __len__(self) -> int:
            return 1

        def __getitem__(self, index: int) -> Any:
            raise KeyError(index)

    assert dataset_fingerprint(Raises() if dataset == "raises" else dataset) is None


def test_plain_values_keeps_what_crosses_processes() -> None:
    value = {
        1: (torch.ones(1), np.float32(2.0), "s", b"b", None, object()),
        "skip": object(),
    }
    plain = plain_values(value)
    assert list(plain) == ["1"]
    assert [type(v) for v in plain["1"]] == [torch.Tensor, torch.Tensor, str, bytes, type(None)]
    with pytest.raises(TypeError, match="object is not comparable across processes"):
        plain_values(value, others="raise")
    assert count_tensors(plain) == 2


def test_outputs_close_compares_tensors_within_tolerances() -> None:
    a = {"y": torch.tensor([1.0, math.nan]), "n": [torch.tensor([1]), 2]}
    assert outputs_close(a, {"y": torch.tensor([1.0, math.nan]), "n": [torch.tensor([1]), 2]})
    nudged = {"y": torch.tensor([1.001, math.nan]), "n": [torch.tensor([1]), 2]}
    assert not outputs_close(a, nudged)
    assert outputs_close(a, nudged, atol=0.01)
    assert not outputs_close(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert not outputs_close(torch.tensor([1]), torch.tensor([2]), atol=5)
    assert not outputs_close([1, 2], [1])
    assert not outputs_close({"a": 1}, {"b": 1})


def test_unsafe_values_name_the_key_path_and_type() -> None:
    saved = OrderedDict(
        hyper=dict(root=PurePosixPath("/d"), lr=np.float64(0.1), ok=[1, "a", torch.zeros(1)])
    )
    assert unsafe_values(saved) == [
        "hyper.root (pathlib.PurePosixPath)",
        "hyper.lr (numpy.float64)",
    ]
    assert unsafe_values([{1, 2}, pickle]) == ["[1] (builtins.module)"]
    assert unsafe_values(PurePosixPath("/")) == ["<root> (pathlib.PurePosixPath)"]


def _records(ids: list[tuple[Any, ...] | None], losses: list[float], lr: float = 0.1) -> list:
    return [
        StepRecord(step=2 + i, batch_idx=2 + i, epoch=0, ids=i_ids, loss=loss, lrs=(lr,))
        for i, (i_ids, loss) in enumerate(zip(ids, losses, strict=True))
    ]


def _checks(reference: list, resumed: list, **options: Any) -> dict[str, tuple[str, str]]:
    options = {"seen_before": {0, 1}, "loader_stateful": True} | options
    checks, _ = compare_trajectories(reference, resumed, **options)
    return {c.name: (c.verdict, c.detail) for c in checks}


def test_an_exact_resume_passes_every_trajectory_check() -> None:
    reference = _records([(4, 5), (6, 7)], [0.9, 0.8])
    checks, pairs = compare_trajectories(
        reference, list(reference), seen_before={0, 1}, loader_stateful=True
    )
    assert [c.verdict for c in checks] == ["pass", "pass", "pass"]
    assert checks[0].detail == "2 micro-batches identical"
    assert [(index, equal) for index, _, _, equal in pairs] == [(0, True), (1, True)]


def test_a_plain_loader_that_replays_is_diagnosed() -> None:
    reference = _records([(4, 5), (6, 7)], [0.9, 0.8])
    replay = _records([(0, 1), (2, 3)], [1.1, 1.0])
    checks = _checks(reference, replay, loader_stateful=False)
    verdict, detail = checks["data_position"]
    assert verdict == "fail"
    assert detail.startswith("micro-batch 0 (step 2): expected ids [4, 5], resumed run saw [0, 1]")
    assert "the DataLoader cannot resume mid-epoch" in detail
    assert "(2 of those compared here)" in detail
    assert checks["loss_trajectory"] == (
        "fail",
        "loss first differ at micro-batch 0 (step 2): 0.9 expected, 1.1 after resume",
    )
    assert checks["lr_trajectory"][0] == "pass"


def test_a_stateful_loader_that_lost_its_position_names_lightning_20550() -> None:
    checks = _checks(_records([(4, 5)], [0.9]), _records([(8, 9)], [0.9]))
    assert "#20550" in checks["data_position"][1]


def test_an_epoch_boundary_resume_that_repeats_the_epoch_is_diagnosed() -> None:
    reference = _records([(4, 5)], [0.9])
    repeated = _records([(0, 1)], [0.9])
    checks = _checks(reference, repeated, at_epoch_boundary=True)
    assert "repeats the previous epoch's examples" in checks["data_position"][1]
    other = _checks(reference, _records([(8, 9)], [0.9]), at_epoch_boundary=True)
    assert "the next epoch's order differs" in other["data_position"][1]


def test_a_resume_that_stops_early_fails_each_trajectory() -> None:
    reference = _records([(4, 5), (6, 7)], [0.9, 0.8])
    checks, pairs = compare_trajectories(
        reference, reference[:1], seen_before=set(), loader_stateful=True
    )
    assert [c.detail for c in checks] == [
        "only 1 of 2 micro-batches ran after the resume",
        "only 1 of 2 micro-batches to compare",
        "only 1 of 2 micro-batches to compare",
    ]
    assert pairs[1][2:] == (None, False)


def test_learning_rates_and_losses_compare_within_tolerances() -> None:
    reference = _records([(4, 5)], [0.9], lr=0.1)
    resumed = _records([(4, 5)], [0.9 + 1e-9], lr=0.1 + 1e-9)
    assert _checks(reference, resumed)["loss_trajectory"][0] == "fail"
    assert _checks(reference, resumed)["lr_trajectory"][1] == (
        "learning rates first differ at micro-batch 0 (step 2): [0.1] expected,"
        " [0.100000001] after resume"
    )
    assert {v for v, _ in _checks(reference, resumed, atol=1e-6).values()} == {"pass"}
    nan = _records([(4, 5)], [math.nan])
    assert _checks(nan, list(nan))["loss_trajectory"][0] == "pass"


def test_batches_without_ids_are_not_checked_and_content_keys_are_named() -> None:
    no_ids = _records([None], [0.9])
    verdict, detail = _checks(no_ids, list(no_ids), loader_stateful=False)["data_position"]
    assert verdict == "not_checked"
    assert "add an id field or give BatchAdapter(ids=...)" in detail
    assert "the training loader is not stateful" in detail
    keyed = _records([(f"{CONTENT_KEY_PREFIX}ab",)], [0.9])
    assert (
        "told apart by the bytes of their inputs" in _checks(keyed, list(keyed))["data_position"][1]
    )
