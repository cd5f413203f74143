"""core/eval_phase.py without a Trainer: what an evaluation loop's batches showed, the samples
expected from its loaders, and its checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_pilot.core.batches import BatchAdapter
from lightning_pilot.core.eval_phase import EvalLoop, expected_samples, limit_name
from lightning_pilot.core.phases import Occurrence


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.ones(6, 2))


def _model(*, train: bool) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    return model.train(train)


def test_batches_add_up_samples_and_keep_the_largest_sizes() -> None:
    loop, model = EvalLoop("test"), _model(train=False)
    for size, length in ((8, 5), (8, 12), (3, 7)):
        view = BatchAdapter().view({"input_ids": torch.ones(size, length, dtype=torch.long)})
        loop.add_batch(view, model.named_modules(), grad_enabled=False)
    assert (loop.samples, loop.batch_size, loop.seq_len) == (19, 8, 12)
    occurrence = Occurrence("test", 4)
    results = loop.finish(occurrence, expected=19, why_unknown="")
    assert (occurrence.values["batch_size"], occurrence.values["seq_len"]) == (8, 12)
    assert [(r.name, r.verdict) for r in results] == [
        ("eval_mode", "pass"),
        ("no_grad", "pass"),
        ("outputs_complete", "pass"),
    ]


def test_train_mode_and_autograd_during_validation_fail() -> None:
    loop, model = EvalLoop("validation"), _model(train=True)
    view = BatchAdapter().view(torch.ones(4, 2))
    loop.add_batch(view, model.named_modules(), grad_enabled=True)
    loop.add_batch(view, model.named_modules(), grad_enabled=False)  # once is enough
    assert set(loop.training) == {"<root>", "0", "1"}
    results = {r.name: r for r in loop.results(expected=10, why_unknown="")}
    assert results["eval_mode"].verdict == "fail"
    assert "1 (Dropout)" in results["eval_mode"].detail
    assert results["no_grad"].verdict == "fail"
    assert results["outputs_complete"].detail == "8 samples validated, expected 10 (a remainder" \
        " was dropped: check drop_last)"  # fmt: skip


def test_predict_is_not_judged_on_its_mode_and_an_unknown_count_is_not_checked() -> None:
    loop = EvalLoop("predict")
    loop.add_batch(BatchAdapter().view(torch.ones(4, 2)), _model(train=True).named_modules(),
                   grad_enabled=True)  # fmt: skip
    [result] = loop.finish(None, expected=None, why_unknown="the predict loader has no sized")
    assert (result.name, result.verdict) == ("outputs_complete", "not_checked")


def test_expected_samples_over_every_loader() -> None:
    ten = DataLoader(list(range(10)), batch_size=4)  # 3 batches
    six = DataLoader(list(range(6)), batch_size=4)  # 2 batches
    assert expected_samples("validation", {"a": ten, "b": six}, 1.0) == (16, "")
    assert expected_samples("test", [ten, six], 3) == (16, "")  # 3 covers both
    assert expected_samples("test", None, 1.0) == (0, "")
    assert expected_samples("predict", [ten, six], 2) == (
        None,
        "limit_predict_batches=2 evaluates part of the data by design",
    )
    assert expected_samples("validation", ten, 0.5)[0] is None
    assert expected_samples("validation", DataLoader(Stream(), batch_size=2), 1.0) == (
        None,
        "the validation loader has no sized sampler",
    )


@pytest.mark.parametrize(
    ("phase", "name"),
    [("validation", "limit_val_batches"), ("test", "limit_test_batches"),
     ("predict", "limit_predict_batches")],
)  # fmt: skip
def test_limit_names(phase: str, name: str) -> None:
    assert limit_name(phase) == name
