"""Conformance zoo: bugs planted in the families of ``zoo_modules.py``, each caught by the check
that names it.

Several bugs that do not interfere share one fit (a data bug, a gradient bug and a loop bug are
read at different phases). Each test asserts the named check's verdict and that its reason
names the cause; the message prints the check and the rows that did not pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conformance_helpers import PilotFit, assert_check, checks_text, runs_text, shared_fits
from conformance_modules import EncoderClassifier
from zoo_modules import (
    RESPONSE_TEMPLATE,
    CaptionDataModule,
    ContrastiveImageText,
    Denoiser,
    ImageDataModule,
    InstructionDataModule,
    LoRACausalLM,
    MoECausalLM,
    SpeechDataModule,
    SpeechSeq2Seq,
    text_loaders,
)

from lightning_pilot.core.divergence import FATAL_CAUSES

NO_RESUME: dict[str, Any] = {"resume": False}
# Only the mid-epoch probe, no artifact round trip: one short new process.
MID_EPOCH_ONLY: dict[str, Any] = {"check_artifact": False, "epoch_boundary": False}

PLANTED: dict[str, dict[str, Any]] = {
    # UNet (dropout 0.1): self.model.eval() in on_train_start, so the whole fit trains in eval
    # mode (dropout off).
    "unet_trained_in_eval_mode": {
        "model": lambda: Denoiser(eval_in_training=True),
        "datamodule": ImageDataModule,
        "pilot": NO_RESUME,
        "trainer": {"max_steps": 4},
    },
    # CLIP: the text tower run under torch.no_grad() in the training forward; the vision tower
    # frozen with requires_grad_(False) before the fit, every parameter still in AdamW.
    "clip_detached_text_frozen_vision": {
        "model": lambda: ContrastiveImageText(detach_text=True, freeze_vision=True),
        "datamodule": CaptionDataModule,
        "pilot": NO_RESUME,
        "trainer": {"max_steps": 4},
    },
    # Whisper: labels shifted by hand once more than the decoder inputs need (2 ahead).
    "whisper_labels_shifted_twice": {
        "model": SpeechSeq2Seq,
        "datamodule": lambda: SpeechDataModule(labels="shifted_twice"),
        "pilot": NO_RESUME,
        "trainer": {"max_steps": 4},
    },
    # peft LoRA: the prompt is a target too, and each example carries its prompt length.
    "lora_unmasked_prompt_length_given": {
        "model": lambda: LoRACausalLM(optimize="trainable"),
        "datamodule": lambda: InstructionDataModule(labels="unmasked"),
        "pilot": {**NO_RESUME, "batch_inspector": {"prompt_length_key": "prompt_length"}},
        "trainer": {"max_steps": 4},
    },
    # Mixtral MoE: the prompt is a target too (the response template given); SGD at lr=1e3.
    "moe_unmasked_template_diverging_lr": {
        "model": lambda: MoECausalLM(optimizer="sgd", lr=1e3),
        "datamodule": lambda: InstructionDataModule(labels="unmasked"),
        "pilot": {
            **NO_RESUME,
            "ledger": {"check_every": 1},
            "batch_inspector": {"response_template": RESPONSE_TEMPLATE},
        },
    },
    # A plain shuffled DataLoader passed straight to fit(model, train_loader, val_loader).
    "plain_loader_passed_to_fit": {
        "model": EncoderClassifier,
        "loaders": lambda: text_loaders("plain"),
        "pilot": {"resume": MID_EPOCH_ONLY},
    },
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], PilotFit]:
    """One fit per planted case, made when a test first asks for it, shared by the others."""
    return shared_fits(tmp_path_factory.mktemp("zoo-planted"), PLANTED)


def _ends(suffix: str) -> Callable[[str], bool]:
    return lambda name: name == suffix or name.endswith("/" + suffix)


def LABEL_SHIFT(name: str) -> bool:  # noqa: N802
    """``<split>/label_shift`` or ``<split>/decoder_label_shift`` (decoder_input_ids + labels)."""
    return name.endswith("label_shift")


# -- modes and gradients -------------------------------------------------------------------------


def test_training_in_eval_mode_fails_the_forward(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("unet_trained_in_eval_mode")
    assert fit.error is None, fit.describe()
    # The UNet's dropout layers (p=0.1) are the modules whose outputs change with the mode.
    assert_check(fit, _ends("train_mode"), "forward", {"fail"}, "eval mode", "dropout")


def test_detached_text_tower_fails_grads_reach_params(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("clip_detached_text_frozen_vision")
    check = assert_check(fit, "grads_reach_params", "backward", {"fail"}, "model.text_model.")
    # The projection after the no_grad block still learns: it is not named.
    assert "text_projection" not in check["detail"], checks_text([check])


def test_frozen_vision_tower_is_named(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("clip_detached_text_frozen_vision")
    # Frozen before the fit and still in the optimizer: a whole tower, named, as a warning (a
    # frozen tower can be intended; this one is not, and the name says which).
    check = assert_check(
        fit,
        "trainable_params_require_grad",
        "backward",
        {"warn"},
        "frozen before the fit",
        "model.vision_model",
    )
    assert "model.text_model" not in check["detail"], checks_text([check])


# -- data ----------------------------------------------------------------------------------------


def test_seq2seq_labels_shifted_twice_fail(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("whisper_labels_shifted_twice")
    assert_check(fit, LABEL_SHIFT, "data", {"fail"}, "decoder_input_ids", "2")


def test_unmasked_prompt_with_prompt_length_fails(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("lora_unmasked_prompt_length_given")
    assert_check(fit, "train/instruction_masked", "data", {"fail"}, "prompt")


def test_unmasked_prompt_with_response_template_fails(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("moe_unmasked_template_diverging_lr")
    assert_check(fit, "train/instruction_masked", "data", {"fail"}, "prompt")


# -- the loop: divergence, resume ----------------------------------------------------------------


def test_diverging_moe_is_a_diverged_run(planted: Callable[[str], PilotFit]) -> None:
    fit = planted("moe_unmasked_template_diverging_lr")
    assert fit.error is None, fit.describe()
    runs = fit.runs()
    assert list(runs["status"]) == ["diverged"], runs_text(runs)
    assert runs.iloc[0]["stop_cause"] in FATAL_CAUSES, runs_text(runs)
    assert fit.trainer is not None
    assert fit.trainer.global_step < 8, runs_text(runs)
    code, output = fit.show()
    assert code == 1, f"lightning-pilot show exited {code} on a diverged pilot:\n{output[-3000:]}"


def test_plain_loader_passed_to_fit_fails_data_position(
    planted: Callable[[str], PilotFit],
) -> None:
    # The same loader in a DataModule is test_conformance_planted.py's
    # lm_double_shift_plain_loader: the same check, one new process fewer here.
    fit = planted("plain_loader_passed_to_fit")
    assert fit.error is None, fit.describe()
    assert_check(
        fit, "data_position", "resume", {"fail"}, "cannot resume mid-epoch", "StatefulDataLoader"
    )
