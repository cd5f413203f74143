"""Conformance zoo: the pilot on the model families users train today, each fit clean.

One pilot fit per family (``pilot_callbacks()`` at its defaults, ResumeVerifier off except for
loaders passed straight to ``fit``, where resuming is the point), shared by every test of that
family: no exception, no ``fail`` in the phase table, the ledger says ``completed``,
``lightning-pilot show`` exits 0, and the exact set of checks that warn, each justified below.
The families and their batches are described in ``zoo_modules.py`` and docs/on-your-model.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from conformance_helpers import (
    PilotFit,
    check_named,
    checks,
    checks_text,
    rows_text,
    runs_text,
    shared_fits,
)
from conformance_modules import EncoderClassifier
from zoo_modules import (
    RESPONSE_TEMPLATE,
    AudioDataModule,
    CaptionDataModule,
    CompiledClassifier,
    ContrastiveImageText,
    Denoiser,
    DetectionDataModule,
    Detector,
    ImageDataModule,
    InstructionDataModule,
    LoRACausalLM,
    MoECausalLM,
    ScheduledLM,
    SpeechCTC,
    SpeechDataModule,
    SpeechSeq2Seq,
    VectorDataModule,
    text_loaders,
)

NO_RESUME: dict[str, Any] = {"resume": False}
FROZEN = "trainable_params_require_grad"


@dataclass(frozen=True)
class Family:
    model: Callable[[], Any]
    datamodule: Callable[[], Any] | None = None
    loaders: Callable[[], Any] | None = None  # trainer.fit(model, train_loader, val_loader)
    pilot: dict[str, Any] = field(default_factory=lambda: dict(NO_RESUME))
    trainer: dict[str, Any] = field(default_factory=dict)
    warns: frozenset[str] = frozenset()  # the checks that warn, each justified where declared


FAMILIES: dict[str, Family] = {
    # 1. peft LoRA, peft's own idiom AdamW(model.parameters()): the frozen base is in the
    # optimizer. trainable_params_require_grad warns and names the frozen base submodules: by
    # design (torch skips them; the warning says "if intended ... nothing to do"), it is the one
    # signal that tells this run apart from a tower frozen by mistake.
    "peft_lora_all_params": Family(LoRACausalLM, InstructionDataModule, warns=frozenset({FROZEN})),
    # 2. peft LoRA, only the trainable parameters in the optimizer: nothing to warn about. The
    # inspector is told where the response is (response_mask_key) and proves the prompt masked.
    "peft_lora_trainable_params": Family(
        lambda: LoRACausalLM(optimize="trainable"),
        InstructionDataModule,
        pilot={**NO_RESUME, "batch_inspector": {"response_mask_key": "response_mask"}},
    ),
    # 3. Whisper: input_features, decoder_input_ids and labels one token ahead of them.
    "whisper_seq2seq": Family(SpeechSeq2Seq, SpeechDataModule),
    # 4. wav2vec2 CTC: raw input_values, labels padded with -100.
    "wav2vec2_ctc": Family(SpeechCTC, AudioDataModule),
    # 5. Mixture of experts (Mixtral, 4 experts, 2 per token, router loss); the prompt is
    # described by the response template the completion-only collators search for.
    "mixtral_moe": Family(
        MoECausalLM,
        InstructionDataModule,
        pilot={**NO_RESUME, "batch_inspector": {"response_template": RESPONSE_TEMPLATE}},
    ),
    # 6. diffusers UNet2DModel + DDPMScheduler: noise prediction, images without labels.
    "diffusers_unet_ddpm": Family(Denoiser, ImageDataModule, trainer={"max_steps": 4}),
    # 7. CLIP: contrastive loss over (input_ids, pixel_values); captions repeat across examples
    # and splits (a caption describes many images), and that is not a duplicate example.
    "clip_contrastive": Family(ContrastiveImageText, CaptionDataModule),
    # 8. DETR with a transformers ResNet backbone, labels a list of dicts (class_labels,
    # boxes). trainable_params_require_grad warns naming model.model.backbone: DetrConvEncoder
    # freezes the backbone parameters whose names lack "stage.1"/"stage.2"/"stage.3" (meant to
    # keep the stem and first stage frozen, as DETR trains); a transformers ResNet names its
    # stages "encoder.stages.N", so the whole backbone is frozen while the module hands every
    # parameter to AdamW. The warning names exactly that tower: right, and worth reading.
    "detr_dict_targets": Family(Detector, DetectionDataModule, warns=frozenset({FROZEN})),
    # 9. torch.compile (default mode) of the network inside the module. The backend is
    # aot_eager: dynamo's graph capture and AOTAutograd's compiled backward, which is where the
    # pilot's hooks, dispatch mode and gradient reads meet the compiler; inductor adds only
    # code generation (about 50 s of C++ compilation on 2 cores here, too slow for CI).
    "torch_compile": Family(
        lambda: CompiledClassifier(backend="aot_eager"), VectorDataModule, trainer={"max_steps": 4}
    ),
    # 10. bf16-mixed, gradient clipping and a per-step OneCycleLR over
    # trainer.estimated_stepping_batches.
    "bf16_clipping_onecycle": Family(
        ScheduledLM,
        InstructionDataModule,
        trainer={"precision": "bf16-mixed", "gradient_clip_val": 1.0},
    ),
    # 11. Loaders passed straight to fit(model, train_loader, val_loader), resume verified by
    # default (a StatefulDataLoader resumes mid-epoch exactly).
    "loaders_passed_to_fit": Family(EncoderClassifier, loaders=text_loaders, pilot={}),
}
RESUMED = [name for name, spec in FAMILIES.items() if spec.pilot.get("resume") is not False]

# Known defects, by test: {test: {family: pytest mark}} (none at present).
KNOWN: dict[str, dict[str, pytest.MarkDecorator]] = {}


def families(test: str) -> list[Any]:
    """Every family, with the known-defect mark of ``test`` where there is one."""
    marks = KNOWN.get(test, {})
    return [pytest.param(name, marks=marks[name]) if name in marks else name for name in FAMILIES]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], PilotFit]:
    """One fit per family, made when a test first asks for it, shared by the others."""
    return shared_fits(tmp_path_factory.mktemp("zoo-clean"), FAMILIES)


@pytest.mark.parametrize("name", families("raises"))
def test_fit_raises_nothing(name: str, zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo(name)
    assert fit.error is None, fit.describe()


@pytest.mark.parametrize("name", families("no_fail"))
def test_no_fail_verdict_in_the_phase_table(name: str, zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo(name)
    table = fit.table()
    assert not table.empty, fit.describe()
    failing = table["verdict"] == "fail"
    assert not failing.any(), f"[{name}] failing rows:\n{rows_text(table[failing])}"


@pytest.mark.parametrize("name", families("warns"))
def test_exactly_the_justified_checks_warn(name: str, zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo(name)
    warned = [c for c in checks(fit.table()) if c["verdict"] == "warn"]
    assert {c["name"] for c in warned} == set(FAMILIES[name].warns), (
        f"[{name}] checks that warn:\n{checks_text(warned)}"
    )


@pytest.mark.parametrize("name", families("ledger"))
def test_ledger_says_completed(name: str, zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo(name)
    runs = fit.runs()
    assert list(runs["status"]) == ["completed"], f"{runs_text(runs)}\n{fit.describe()}"


@pytest.mark.parametrize("name", families("show"))
def test_show_exits_zero(name: str, zoo: Callable[[str], PilotFit]) -> None:
    code, output = zoo(name).show()
    assert code == 0, f"lightning-pilot show exited {code}:\n{output[-3000:]}"


# -- what each family exercises --------------------------------------------------------------------


def _verdicts(fit: PilotFit, name: str | Callable[[str], bool], phase: str) -> list[str]:
    found = check_named(fit.table(), name, phase=phase)
    assert found, f"[{fit.name}] no check {name!r} in {phase}:\n{fit.describe()}"
    return [c["verdict"] for c in found]


def _ends(suffix: str) -> Callable[[str], bool]:
    return lambda name: name == suffix or name.endswith("/" + suffix)


def LABEL_SHIFT(name: str) -> bool:  # noqa: N802
    """``<split>/label_shift`` or ``<split>/decoder_label_shift`` (decoder_input_ids + labels)."""
    return name.endswith("label_shift")


def test_peft_frozen_base_warning_names_the_base(zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo("peft_lora_all_params")
    found = check_named(fit.table(), FROZEN, phase="backward")
    assert found, fit.describe()
    assert {c["verdict"] for c in found} == {"warn"}, checks_text(found)
    detail = found[0]["detail"]
    assert "frozen before the fit" in detail, checks_text(found)
    assert "base_layer" in detail or "embed_tokens" in detail, checks_text(found)
    assert "lora_" not in detail, f"a LoRA adapter named as frozen:\n{checks_text(found)}"


@pytest.mark.parametrize(
    "name", ["peft_lora_trainable_params", "mixtral_moe", "bf16_clipping_onecycle"]
)
def test_prompt_masked_instruction_data_passes(name: str, zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo(name)
    assert _verdicts(fit, "train/instruction_masked", "data") == ["pass"], fit.describe()


def test_whisper_decoder_labels_one_ahead_pass(zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo("whisper_seq2seq")
    # labels[t] == decoder_input_ids[t + 1]: the teacher-forcing convention, not a double shift.
    assert set(_verdicts(fit, LABEL_SHIFT, "data")) == {"pass"}, fit.describe()


def test_wav2vec2_missing_gradients_are_layers_layerdrop_skipped(
    zoo: Callable[[str], PilotFit],
) -> None:
    fit = zoo("wav2vec2_ctc")
    assert fit.model is not None
    assert fit.model.model.config.layerdrop == 0.1  # the released checkpoints' value
    found = check_named(fit.table(), "grads_reach_params", phase="backward")
    assert found, fit.describe()
    # Judged over the measured updates: a layer LayerDrop skipped in some of them passes, named
    # in the detail (whether a skip lands on a measured update depends on the random stream;
    # tests/callbacks/test_phase_checks_stock_models.py makes one land for certain).
    assert {c["verdict"] for c in found} == {"pass"}, checks_text(found)
    for check in found:
        if "received no gradient in some of" in check["detail"]:
            named = check["detail"].rsplit("): ", 1)[1].split(" and ")[0].split(", ")
            stray = [n for n in named if not n.startswith("model.wav2vec2.encoder.layers.")]
            assert not stray, checks_text([check])


def test_unet_trains_in_train_mode(zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo("diffusers_unet_ddpm")
    assert set(_verdicts(fit, _ends("train_mode"), "forward")) == {"pass"}, fit.describe()


def test_detr_backbone_is_named_frozen(zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo("detr_dict_targets")
    found = check_named(fit.table(), FROZEN, phase="backward")
    assert found, fit.describe()
    assert "model.model.backbone" in found[0]["detail"], checks_text(found)
    backbone = fit.model.model.model.backbone  # type: ignore[union-attr]
    assert not any(p.requires_grad for p in backbone.parameters())  # what transformers did


def test_the_compiled_network_ran(zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo("torch_compile")
    assert fit.model is not None
    assert hasattr(fit.model.net, "_orig_mod"), "configure_model did not compile the network"
    forward = fit.table().query("phase == 'forward'")
    assert len(forward) == 2, fit.describe()  # the first (compiling) and the later forwards
    assert set(forward["verdict"]) == {"pass"}, fit.describe()


# On CPU, PhaseMemoryMonitor's tensor tracker is a TorchDispatchMode: dynamo does not compile a
# frame while one is active, so the monitor leaves it off for a module with compiled code.
def test_the_training_step_runs_compiled(zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo("torch_compile")
    assert fit.model is not None
    assert "train" in fit.model.compiled_graphs, fit.model.compiled_graphs


def test_bf16_rows_and_a_per_step_schedule(zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo("bf16_clipping_onecycle")
    table = fit.table()
    assert set(table["precision"].dropna()) == {"bf16-mixed"}, fit.describe()
    assert fit.trainer is not None
    scheduler = fit.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == fit.trainer.global_step == 8  # stepped once per update


def test_loaders_passed_to_fit_resume_is_verified(zoo: Callable[[str], PilotFit]) -> None:
    fit = zoo("loaders_passed_to_fit")
    table = fit.table()
    resume = table[table["phase"] == "resume"]
    assert len(resume) == 1, fit.describe()
    found = check_named(table, lambda name: True, phase="resume")
    assert resume.iloc[0]["verdict"] == "pass", (
        f"resume {resume.iloc[0]['verdict']}: {resume.iloc[0]['reason']}\n{checks_text(found)}"
    )
