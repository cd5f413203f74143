"""PhaseMemoryMonitor's model checks on stock third-party models, in real CPU fits.

No false fail on what the libraries do by design (Whisper freezes its encoder's position table;
peft's own idiom hands the frozen base to AdamW; a frozen BatchNorm tower kept in eval mode),
and a fail where training cannot be right (a UNet trained in eval mode, its dropout off).
Each model is built from a tiny config (nothing downloaded); each fit is shared by its tests.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pilot import PhaseMemoryMonitor, read_phase_table

transformers = pytest.importorskip("transformers")

FitFn = Callable[[pl.LightningModule], pd.DataFrame]

#: A seed at which wav2vec2's LayerDrop skips a layer in a measured update and runs it in another.
SKIP_SEED = 2
#: The model of each fit, by name (the fixture's fits).
MODELS: dict[str, pl.LightningModule] = {}


class _Tensors(Dataset[dict[str, torch.Tensor]]):
    """Examples as dicts of tensors, made once from a seed."""

    def __init__(self, **columns: torch.Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: column[index] for name, column in self.columns.items()}


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _Module(pl.LightningModule):
    """``self.model(**batch).loss``, AdamW over ``self.parameters()``, random data."""

    model: nn.Module
    data: _Tensors

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=4)


class WhisperSeq2Seq(_Module):
    """A stock ``WhisperForConditionalGeneration``: its encoder freezes ``embed_positions``."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.WhisperConfig(
            vocab_size=100,
            num_mel_bins=8,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_source_positions=8,
            max_target_positions=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
        self.model = transformers.WhisperForConditionalGeneration(config)
        generator = _generator()
        self.data = _Tensors(
            input_features=torch.randn(16, 8, 16, generator=generator),  # 2 x source positions
            labels=torch.randint(3, 100, (16, 6), generator=generator),
        )


class LoRAGPT2(_Module):
    """peft LoRA on a tiny GPT-2; ``optimize="all"`` is peft's ``AdamW(model.parameters())``."""

    def __init__(self, optimize: str) -> None:
        super().__init__()
        peft = pytest.importorskip("peft")
        config = transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32
        )
        lora = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
        self.model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), lora)
        self.optimize = optimize
        tokens = torch.randint(0, 50, (16, 8), generator=_generator())
        self.data = _Tensors(input_ids=tokens, labels=tokens)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimize == "all":
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=1e-3)


class FrozenBatchNormBackbone(_Module):
    """A transformers ResNet backbone frozen and kept in eval mode (its BatchNorm running
    statistics fixed), a linear head trained on its pooled features: a fine-tuning idiom."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]
        )
        self.backbone = transformers.ResNetModel(config)
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(16, 4)
        generator = _generator()
        self.data = _Tensors(
            pixel_values=torch.randn(16, 3, 16, 16, generator=generator),
            labels=torch.randint(0, 4, (16,), generator=generator),
        )

    def on_train_start(self) -> None:
        self.backbone.eval()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features = self.backbone(pixel_values=batch["pixel_values"]).pooler_output.flatten(1)
        return nn.functional.cross_entropy(self.head(features), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.head.parameters(), lr=1e-3)


class UNetDenoiser(_Module):
    """A diffusers ``UNet2DModel`` (dropout 0.1) predicting the noise added to images;
    ``eval_in_training=True`` calls ``self.model.eval()`` in ``on_train_start``."""

    def __init__(self, eval_in_training: bool) -> None:
        super().__init__()
        diffusers = pytest.importorskip("diffusers")
        self.model = diffusers.UNet2DModel(
            sample_size=8,
            in_channels=3,
            out_channels=3,
            block_out_channels=(8, 16),
            layers_per_block=1,
            norm_num_groups=4,
            dropout=0.1,
            down_block_types=("DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D"),
        )
        self.eval_in_training = eval_in_training
        generator = _generator()
        self.data = _Tensors(
            images=torch.randn(16, 3, 8, 8, generator=generator),
            noise=torch.randn(16, 3, 8, 8, generator=generator),
            timesteps=torch.randint(0, 1000, (16,), generator=generator),
        )

    def on_train_start(self) -> None:
        if self.eval_in_training:
            self.model.eval()  # the planted bug: dropout is off for the whole fit

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        noisy = batch["images"] + batch["noise"]
        predicted = self.model(noisy, batch["timesteps"]).sample
        return nn.functional.mse_loss(predicted, batch["noise"])


class Wav2Vec2LayerDrop(_Module):
    """A stock ``Wav2Vec2ForCTC`` with LayerDrop (``layerdrop=0.5`` over 2 encoder layers; the
    released checkpoints use 0.1): a skipped layer gets no gradient in that step. The random
    streams are seeded at train start, so the same layers are skipped in every run; ``ran``
    lists the encoder layers that ran in each training step. ``detach_head=True`` (planted)
    feeds the CTC head a detached encoder output: the whole encoder never learns."""

    def __init__(self, detach_head: bool = False, seed: int = SKIP_SEED) -> None:
        super().__init__()
        config = transformers.Wav2Vec2Config(
            vocab_size=12,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            conv_dim=(8, 8),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=2,
            pad_token_id=0,
            ctc_loss_reduction="mean",
            layerdrop=0.5,
        )
        self.model = transformers.Wav2Vec2ForCTC(config)
        if detach_head:  # what lm_head reads is cut from the graph (the same random draws)
            self.model.lm_head.register_forward_pre_hook(lambda _, args: (args[0].detach(),))
        self.seed = seed
        self.ran: list[list[int]] = []
        for index, layer in enumerate(self.model.wav2vec2.encoder.layers):
            layer.register_forward_hook(lambda *_, index=index: self.ran[-1].append(index))
        generator = _generator()
        self.data = _Tensors(
            input_values=torch.randn(12, 400, generator=generator),
            labels=torch.randint(1, 12, (12, 8), generator=generator),
        )

    def on_train_start(self) -> None:
        import numpy

        torch.manual_seed(self.seed)  # LayerDrop draws torch.rand per layer and step
        numpy.random.seed(self.seed)  # SpecAugment's time mask draws from numpy

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.ran.append([])
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def fit(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], pd.DataFrame]:
    """The phase table of one short fit per model, made when a test first asks for it."""
    makers: dict[str, Callable[[], pl.LightningModule]] = {
        "whisper": WhisperSeq2Seq,
        "lora_all": lambda: LoRAGPT2("all"),
        "lora_trainable": lambda: LoRAGPT2("trainable"),
        "frozen_bn": FrozenBatchNormBackbone,
        "unet_eval": lambda: UNetDenoiser(eval_in_training=True),
        "unet_train": lambda: UNetDenoiser(eval_in_training=False),
        "wav2vec2_layerdrop": Wav2Vec2LayerDrop,
        "wav2vec2_detached_head": lambda: Wav2Vec2LayerDrop(detach_head=True),
    }
    done: dict[str, pd.DataFrame] = {}

    def get(name: str) -> pd.DataFrame:
        if name not in done:
            root: Path = tmp_path_factory.mktemp(name)
            monitor = PhaseMemoryMonitor()
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=3,
                limit_val_batches=0,
                callbacks=[monitor],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=root,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                MODELS[name] = model = makers[name]()
                trainer.fit(model)
            done[name] = read_phase_table(monitor.run.run_dir)
        return done[name]

    return get


def _check(frame: pd.DataFrame, phase: str, name: str, first: bool = True) -> dict[str, str]:
    row = frame[(frame["phase"] == phase) & (frame["first"] == first)].iloc[0]
    found = [dict(c) for c in row["checks"] if c["name"] == name]
    assert len(found) == 1, f"no single check {name!r} in {row['checks']}"
    return found[0]


def _not_passed(frame: pd.DataFrame) -> dict[str, str]:
    rows = frame[frame["verdict"] != "pass"]
    return {f"{r.phase} first={r.first}": f"{r.verdict}: {r.reason}" for r in rows.itertuples()}


def test_whisper_frozen_position_table_passes_named(fit: Callable[[str], Any]) -> None:
    frame = fit("whisper")
    assert _not_passed(frame) == {}
    for first in (True, False):
        assert _check(frame, "backward", "trainable_params_require_grad", first) == {
            "name": "trainable_params_require_grad",
            "verdict": "pass",
            "detail": "1 lone parameter(s) frozen before the fit (requires_grad=False) are in the"
            " optimizer, which skips them: model.model.encoder.embed_positions.weight",
        }
        assert _check(frame, "forward", "train_mode", first)["verdict"] == "pass"


def test_peft_adamw_over_every_parameter_warns_naming_the_frozen_base(
    fit: Callable[[str], Any],
) -> None:
    frame = fit("lora_all")
    assert "fail" not in set(frame["verdict"]), _not_passed(frame)
    # The backward rows warn, and nothing else: the run trains its adapter correctly.
    assert set(_not_passed(frame)) == {"backward first=True", "backward first=False"}
    check = _check(frame, "backward", "trainable_params_require_grad")
    assert check["verdict"] == "warn"
    # The base: 16 tensors, 4,624 of the 4,752 optimized elements; the adapter: 128.
    base = "model.base_model.model.transformer"
    assert check["detail"].startswith(
        "16 parameter(s) frozen before the fit (requires_grad=False, 97.3% of the optimized"
        f" elements) are in the optimizer, in 8 frozen submodule(s): {base}.wte, {base}.wpe,"
        f" {base}.h.0.ln_1, {base}.h.0.attn.c_attn.base_layer, {base}.h.0.attn.c_proj,"
        f" {base}.h.0.ln_2, {base}.h.0.mlp, {base}.ln_f; torch skips them; if intended (adapter"
        " training, a frozen tower) nothing to do"
    )
    assert "lora" not in check["detail"]


def test_peft_adamw_over_the_trainable_parameters_passes(fit: Callable[[str], Any]) -> None:
    frame = fit("lora_trainable")
    assert _not_passed(frame) == {}
    check = _check(frame, "backward", "trainable_params_require_grad")
    assert check == {"name": "trainable_params_require_grad", "verdict": "pass", "detail": ""}


def test_frozen_batchnorm_tower_kept_in_eval_mode_passes(fit: Callable[[str], Any]) -> None:
    frame = fit("frozen_bn")
    assert _not_passed(frame) == {}
    for first in (True, False):
        check = _check(frame, "forward", "train_mode", first)
        assert check["verdict"] == "pass"
        assert check["detail"].endswith(
            "module(s) in eval mode hold (or sit in a module holding) only frozen parameters,"
            " kept in eval mode on purpose (a frozen BatchNorm or tower): backbone"
        )


def test_unet_trained_in_eval_mode_fails_naming_its_dropout(fit: Callable[[str], Any]) -> None:
    frame = fit("unet_eval")
    dropouts = [
        f"model.{block}.resnets.{i}.dropout (Dropout)"
        for block, count in (
            ("down_blocks.0", 1),
            ("down_blocks.1", 1),
            ("up_blocks.0", 2),
            ("up_blocks.1", 2),
            ("mid_block", 2),
        )
        for i in range(count)
    ]
    for first in (True, False):  # every measured training step, the first and the later ones
        check = _check(frame, "forward", "train_mode", first)
        assert check["verdict"] == "fail"
        assert check["detail"].startswith(
            "8 module(s) whose outputs change with the mode are in eval mode during the training"
            f" step: {', '.join(dropouts)}; "
        )
        assert check["detail"].endswith(
            "call .train() on them, or do not call .eval() in on_train_start or another hook"
            " (Lightning does not switch modules back to train mode when training starts)"
        )
    # Only the forward rows fail: the gradients and updates are as they should be.
    assert set(_not_passed(frame)) == {"forward first=True", "forward first=False"}


def test_unet_trained_in_train_mode_passes(fit: Callable[[str], Any]) -> None:
    frame = fit("unet_train")
    assert _not_passed(frame) == {}
    for first in (True, False):
        assert _check(frame, "forward", "train_mode", first) == {
            "name": "train_mode",
            "verdict": "pass",
            "detail": "",
        }


def test_wav2vec2_layerdrop_skipping_a_layer_passes_named(fit: Callable[[str], Any]) -> None:
    frame = fit("wav2vec2_layerdrop")
    model = MODELS["wav2vec2_layerdrop"]
    assert isinstance(model, Wav2Vec2LayerDrop)
    # The encoder layers that ran in each of the 3 measured updates: layer 0 was skipped in the
    # first (the first backward row) and ran in the second; the third skipped both.
    assert model.ran == [[1], [0, 1], []]
    assert _not_passed(frame) == {}
    layer0 = "model.wav2vec2.encoder.layers.0."
    for first in (True, False):
        reach = _check(frame, "backward", "grads_reach_params", first)
        assert reach["verdict"] == "pass"
        assert (
            " measured backward(s) and one in another (a layer skipped by LayerDrop"
            in (reach["detail"])
        )
        assert layer0 + "attention.k_proj.weight" in reach["detail"]
        changed = _check(frame, "optimizer_step", "trainable_params_changed", first)
        assert changed["verdict"] == "pass"
        assert (
            "so the optimizer skipped them there, and received one in another"
            in (changed["detail"])
        )
    # The first row names layer 0 only (16 tensors); the later rows both layers (32).
    assert _check(frame, "backward", "grads_reach_params")["detail"].startswith(
        "16 trainable parameter(s) received no gradient in some of 3 measured backward(s)"
    )
    assert _check(frame, "backward", "grads_reach_params", False)["detail"].startswith("32 ")


def test_wav2vec2_detached_head_still_fails(fit: Callable[[str], Any]) -> None:
    frame = fit("wav2vec2_detached_head")
    assert MODELS["wav2vec2_detached_head"].ran == [[1], [0, 1], []]  # type: ignore[attr-defined]
    for first in (True, False):
        reach = _check(frame, "backward", "grads_reach_params", first)
        assert reach["verdict"] == "fail"
        assert reach["detail"].startswith(
            "trainable parameter(s) received no gradient in any of 3 measured backward(s) (not"
            " in the graph of the loss, or detached): model.wav2vec2.",
            reach["detail"].index(" ") + 1,
        )
        changed = _check(frame, "optimizer_step", "trainable_params_changed", first)
        assert changed["verdict"] == "fail"
        assert "received no gradient in any measured backward did not change" in changed["detail"]
    # The head itself learns: only the encoder side is named.
    assert "lm_head" not in _check(frame, "backward", "grads_reach_params")["detail"]
