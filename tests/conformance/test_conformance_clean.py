"""Conformance: the pilot on real modules nobody on this project wrote, each fit clean.

One pilot fit per module (``pilot_callbacks()`` with its defaults; ResumeVerifier on where
resuming is what the module exercises), shared by every test of that module: no exception, no
``fail`` in the phase table, the ledger says ``completed``, and ``lightning-pilot show`` exits 0.
A user adopts or uninstalls the pilot on the first run of their own module: a false alarm here
is a lost user.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conformance_helpers import (
    PilotFit,
    check_named,
    checks_text,
    rows_text,
    runs_text,
    shared_fits,
)
from conformance_modules import (
    CausalLM,
    DemoTransformerLM,
    EncoderClassifier,
    GroupedTextDataModule,
    ImageClassifier,
    LoRAClassifier,
    PromptResponseDataModule,
    Seq2SeqLM,
    TinyGAN,
    TranslationDataModule,
    example_group,
)
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel


@dataclass(frozen=True)
class Clean:
    model: Callable[[], Any]
    datamodule: Callable[[], Any] | None = None
    pilot: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    after: Callable[[PilotFit], None] | None = None


def _test_after_fit(fit: PilotFit) -> None:
    # The DataModule builds its test split only in setup("test"): a test run after the fit.
    assert fit.trainer is not None
    fit.trainer.test(fit.model, datamodule=fit.datamodule, verbose=False)


NO_RESUME: dict[str, Any] = {"resume": False}

CLEAN: dict[str, Clean] = {
    # a. GPT2LMHeadModel, HF labels (prompt and padding -100), loss from the model.
    "hf_causal_lm": Clean(CausalLM, PromptResponseDataModule),
    # b. + h. BertForSequenceClassification on a DataModule that splits by group per stage.
    "hf_encoder_grouped_datamodule": Clean(
        EncoderClassifier,
        GroupedTextDataModule,
        pilot={"batch_inspector": {"group_fn": example_group}},
        after=_test_after_fit,
    ),
    # c. ResNetForImageClassification: (x, y) batches, forward(x), no predict_step.
    "hf_vision_xy": Clean(ImageClassifier),
    # d. lightning.pytorch.demos.Transformer on random tokens.
    "lightning_demo_transformer": Clean(DemoTransformerLM, pilot=NO_RESUME),
    # e. BoringModel + BoringDataModule (its plain loader resumes exactly from an epoch
    # boundary: 4 batches per epoch, the checkpoint after update 4).
    "boring_model_datamodule": Clean(
        BoringModel,
        BoringDataModule,
        pilot={"resume": {"at_step": 4}},
        trainer={"limit_train_batches": 4},
    ),
    # f. Manual optimisation, two optimizers (toggle_optimizer / manual_backward).
    "manual_two_optimizers": Clean(TinyGAN),
    # g. A frozen base, only a LoRA-style adapter in the optimizer.
    "frozen_base_lora_adapter": Clean(LoRAClassifier, GroupedTextDataModule, pilot=NO_RESUME),
    # i. T5ForConditionalGeneration: decoder labels padded to the inputs' length (a false
    # padding_not_in_loss fail before the inspector knew encoder-decoder models).
    "hf_seq2seq_same_length_padding": Clean(Seq2SeqLM, TranslationDataModule, pilot=NO_RESUME),
}
# Each resume check starts a new Python process (5-10 s on 2 cores, most of it importing
# Lightning): it stays on where resuming is what the module exercises.
RESUMED = [name for name, spec in CLEAN.items() if spec.pilot.get("resume") is not False]


@pytest.fixture(scope="module")
def clean_fits(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], PilotFit]:
    """One fit per module, made when a test first asks for it, shared by the others."""
    return shared_fits(tmp_path_factory.mktemp("conformance-clean"), CLEAN)


@pytest.fixture(params=list(CLEAN))
def clean(request: pytest.FixtureRequest, clean_fits: Callable[[str], PilotFit]) -> PilotFit:
    return clean_fits(request.param)


def test_fit_raises_nothing(clean: PilotFit) -> None:
    assert clean.error is None, clean.describe()


def test_no_fail_verdict_in_the_phase_table(clean: PilotFit) -> None:
    table = clean.table()
    assert not table.empty, clean.describe()
    failing = table["verdict"] == "fail"
    assert not failing.any(), f"[{clean.name}] failing rows:\n{rows_text(table[failing])}"


def test_every_phase_of_the_fit_was_written(clean: PilotFit) -> None:
    phases = set(clean.table()["phase"])
    expected = {"setup", "data", "forward", "backward", "optimizer_step", "validation"}
    if clean.name in RESUMED:
        expected.add("resume")
    assert expected <= phases, f"missing {sorted(expected - phases)}\n{clean.describe()}"


def test_ledger_says_completed(clean: PilotFit) -> None:
    runs = clean.runs()
    assert len(runs) == 1, f"{runs_text(runs)}\n{clean.describe()}"
    assert set(runs["status"]) == {"completed"}, f"{runs_text(runs)}\n{clean.describe()}"


def test_show_exits_zero(clean: PilotFit) -> None:
    code, output = clean.show()
    assert code == 0, f"lightning-pilot show exited {code}:\n{output[-3000:]}"


@pytest.mark.parametrize("name", RESUMED)
def test_resume_is_verified(name: str, clean_fits: Callable[[str], PilotFit]) -> None:
    clean = clean_fits(name)
    # Every module is rebuilt in a new process from its import path and hyperparameters:
    # the resume row must be a verified pass, not "not_checked" (rebuild impossible).
    table = clean.table()
    resume = table[table["phase"] == "resume"]
    assert len(resume) == 1, clean.describe()
    found = check_named(table, lambda name: True, phase="resume")
    assert resume.iloc[0]["verdict"] == "pass", (
        f"resume {resume.iloc[0]['verdict']}: {resume.iloc[0]['reason']}\n{checks_text(found)}"
    )


def test_hf_batches_are_read_as_the_loss_sees_them(
    clean_fits: Callable[[str], PilotFit],
) -> None:
    clean = clean_fits("hf_causal_lm")
    table = clean.table()
    masked = check_named(table, "train/instruction_masked", phase="data")
    assert [c["verdict"] for c in masked] == ["pass"], checks_text(masked)
    label_range = check_named(table, "train/label_range", phase="data")
    assert [c["verdict"] for c in label_range] == ["pass"], checks_text(label_range)
    assert "64 outputs" in label_range[0]["detail"], checks_text(label_range)


def test_grouped_splits_do_not_leak_and_the_test_stage_runs(
    clean_fits: Callable[[str], PilotFit],
) -> None:
    clean = clean_fits("hf_encoder_grouped_datamodule")
    table = clean.table()
    leakage = check_named(table, "split_leakage", phase="data")
    assert [c["verdict"] for c in leakage] == ["pass"], checks_text(leakage)
    assert "test" in set(table["phase"]), clean.describe()


def test_frozen_base_is_not_a_false_alarm(clean_fits: Callable[[str], PilotFit]) -> None:
    clean = clean_fits("frozen_base_lora_adapter")
    table = clean.table()
    found = [
        *check_named(table, "trainable_params_require_grad"),
        *check_named(table, "grads_reach_params"),
        *check_named(table, "frozen_params_unchanged"),
        *check_named(table, "trainable_params_changed"),
    ]
    assert found, clean.describe()
    assert {c["verdict"] for c in found} == {"pass"}, checks_text(found)
