"""Conformance: bugs planted in real modules, each caught by the check that names it.

Several bugs that do not interfere share one fit (a data bug, a gradient bug and a loop bug
are read at different phases). Each test asserts the named check's verdict and that its
reason names the cause; the message prints the check and the rows that did not pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conformance_helpers import (
    PilotFit,
    assert_check,
    check_named,
    checks_text,
    rows_text,
    runs_text,
    shared_fits,
    worst_check,
)
from conformance_modules import (
    CausalLM,
    EncoderClassifier,
    GroupedTextDataModule,
    ImageClassifier,
    PromptResponseDataModule,
    example_group,
)

from lightning_pilot.core.divergence import FATAL_CAUSES

NO_RESUME: dict[str, Any] = {"resume": False}

PLANTED: dict[str, dict[str, Any]] = {
    # Causal LM: the prompt is a target too; SGD at lr=1e3 blows the loss up.
    "lm_unmasked_prompt_diverging_lr": {
        "model": lambda: CausalLM(optimizer="sgd", lr=1e3),
        "datamodule": lambda: PromptResponseDataModule(labels="unmasked"),
        "pilot": {**NO_RESUME, "ledger": {"check_every": 1}},
    },
    # Causal LM: labels shifted by hand for a model that shifts again; a plain shuffled
    # DataLoader resumed mid-epoch (only the mid-epoch probe: one new process).
    "lm_double_shift_plain_loader": {
        "model": CausalLM,
        "datamodule": lambda: PromptResponseDataModule(labels="shifted", loader="plain"),
        "pilot": {"resume": {"check_artifact": False, "epoch_boundary": False}},
    },
    # Causal LM: every label is -100, nothing counts in the loss.
    "lm_all_labels_ignored": {
        "model": CausalLM,
        "datamodule": lambda: PromptResponseDataModule(labels="ignored"),
        "pilot": NO_RESUME,
        "trainer": {"max_steps": 4},
    },
    # Encoder classifier: labels 0..4 for a head of 3 classes (cross_entropy raises).
    "encoder_labels_outside_head": {
        "model": lambda: EncoderClassifier(num_labels=3),
        "datamodule": lambda: GroupedTextDataModule(label_values=5),
        "pilot": NO_RESUME,
    },
    # Encoder classifier: a group in train and validation; the classifier fed a detached
    # encoder output; 5 micro-batches per epoch with accumulate_grad_batches=2 (a last
    # window of 1 micro-batch, stepped at weight 0.5).
    "encoder_leak_detached_partial_window": {
        "model": lambda: EncoderClassifier(detach_head=True),
        "datamodule": lambda: GroupedTextDataModule(train_groups=5, leak=True),
        "pilot": {**NO_RESUME, "batch_inspector": {"group_fn": example_group}},
        "trainer": {"accumulate_grad_batches": 2, "max_steps": 4},
    },
    # Vision (x, y): a frozen head still in the optimizer; train mode inside validation_step.
    "vision_frozen_head_train_mode_validation": {
        "model": lambda: ImageClassifier(freeze_head=True, validate_in_train_mode=True),
        "pilot": NO_RESUME,
    },
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], PilotFit]:
    """One fit per planted case, made when a test first asks for it, shared by the others."""
    return shared_fits(tmp_path_factory.mktemp("conformance-planted"), PLANTED)


# -- data: what the loss is fed ------------------------------------------------------------------


def test_unmasked_prompt_is_flagged(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("lm_unmasked_prompt_diverging_lr")
    assert_check(fit, "train/instruction_masked", "data", {"warn"}, "prompt")


def test_all_labels_ignored_is_flagged(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("lm_all_labels_ignored")
    assert_check(
        fit,
        "train/loss_positions_present",
        "data",
        {"warn", "fail"},
        "no position counted in the loss",
    )
    # Nothing counts, so the mean over no position is NaN: the forward check says so.
    assert_check(fit, "loss_finite", "forward", {"fail"}, "nan")


def test_labels_outside_the_head_fail_the_data_check(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("encoder_labels_outside_head")
    # cross_entropy raises on CPU: the user's own error propagates, unchanged...
    assert fit.error is not None, "labels 3 and 4 for 3 classes: cross_entropy should raise"
    assert not type(fit.error).__module__.startswith("lightning_pilot"), fit.error_text
    # ...and the data row written on the way out explains it.
    in_range = "label_range"
    assert_check(
        fit, lambda name: name.endswith(in_range), "data", {"fail"}, "outside [0, 2]", "3 outputs"
    )


def test_double_shift_is_flagged(planted: Callable[[str], PilotFit]) -> None:
    # GPT2LMHeadModel shifts labels itself: labels shifted by hand train token t+2 from t.
    fit = planted("lm_double_shift_plain_loader")
    assert_check(fit, "train/label_shift", "data", {"warn"}, "shifted left by 1", "GPT2LMHeadModel")


def test_split_leakage_is_flagged(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("encoder_leak_detached_partial_window")
    assert_check(
        fit, "split_leakage", "data", {"fail"}, "found in more than one split", "train+val"
    )


# -- gradients and modes -------------------------------------------------------------------------


def test_detached_head_is_flagged(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("encoder_leak_detached_partial_window")
    assert_check(fit, "grads_reach_params", "backward", {"fail"}, "detached", "model.bert.")


def test_frozen_head_in_the_optimizer_is_flagged(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("vision_frozen_head_train_mode_validation")
    # Frozen before the fit: torch skips it, so the run is not failed, but the whole head is
    # named as a warning (a frozen submodule may be a mistake; the remedy says how to tell).
    assert_check(
        fit,
        "trainable_params_require_grad",
        "backward",
        {"warn"},
        "frozen before the fit",
        "requires_grad=False",
        "frozen submodule(s): model.classifier;",
        "otherwise set requires_grad=True before the fit",
    )


def test_train_mode_validation_is_flagged(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("vision_frozen_head_train_mode_validation")
    # The modules whose outputs depend on the mode (ResNet's BatchNorm layers, "normalization"),
    # not the containers that hold them.
    assert_check(fit, "eval_mode", "validation", {"fail"}, "train mode", "normalization")
    detail = worst_check(fit, "eval_mode", "validation")["detail"]
    assert "<root>" not in detail, f"containers listed: {detail}"
    named = detail.rsplit(": ", 1)[-1].split(", ")
    containers = [n for n in named if n in ("model", "model.resnet", "model.classifier")]
    assert not containers, f"containers listed: {containers} in {detail}"


# -- the loop: divergence, resume, accounting ----------------------------------------------------


def test_diverging_lr_is_a_diverged_run(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("lm_unmasked_prompt_diverging_lr")
    assert fit.error is None, fit.describe()
    runs = fit.runs()
    assert list(runs["status"]) == ["diverged"], runs_text(runs)
    row = runs.iloc[0]
    assert row["stop_cause"] in FATAL_CAUSES, runs_text(runs)
    assert "loss" in str(row["stop_detail"]).lower(), runs_text(runs)
    # Training stopped where the rule fired, well before max_steps=8.
    assert fit.trainer is not None
    assert fit.trainer.global_step < 8, runs_text(runs)


def test_show_fails_on_a_diverged_run(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("lm_unmasked_prompt_diverging_lr")
    code, output = fit.show()
    assert code == 1, f"lightning-pilot show exited {code} on a diverged pilot:\n{output[-3000:]}"


def test_plain_loader_resumed_mid_epoch_fails_data_position(
    planted: Callable[[str], PilotFit],
) -> None:
    fit = planted("lm_double_shift_plain_loader")
    assert fit.error is None, fit.describe()
    assert_check(
        fit, "data_position", "resume", {"fail"}, "cannot resume mid-epoch", "StatefulDataLoader"
    )


def test_partial_accumulation_window_is_a_warning(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("encoder_leak_detached_partial_window")
    assert fit.error is None, fit.describe()
    summary = fit.callback("EffectiveBatchAccountant").summary
    flags = [f["flag"] for f in summary["flags"]]
    assert "last_window_partial" in flags, summary
    # The verdict: a warning in the phase table, naming the partial window and its weight.
    table = fit.table()
    found = check_named(table, lambda name: "partial" in name)
    assert [c["verdict"] for c in found] == ["warn"], (
        f"expected one 'partial' window check with verdict warn:\n{checks_text(found)}\n"
        f"rows that did not pass:\n{rows_text(table, ('fail', 'warn'))}"
    )
    assert "0.5" in str(found[0]["detail"]), checks_text(found)
