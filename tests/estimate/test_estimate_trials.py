"""Stock third-party models (transformers, peft, diffusers; tiny configs, nothing downloaded)
estimated as a user would: each case here failed or answered wrongly once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from estimate_models import token_batch
from lightning.pytorch import LightningModule

from lightning_pilot.estimate import PHASE_ORDER, estimate, grid, measure_cpu
from lightning_pilot.estimate.grid import trace_configuration
from lightning_pilot.estimate.session import Session


class Stock(LightningModule):
    """A stock model whose forward returns its loss (``model(**batch).loss``), AdamW."""

    def __init__(self, build: Callable[[], Any]) -> None:
        super().__init__()
        self.model = build()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def t5() -> Any:
    """T5 learns its attention bias (relative positions), added to the scores as a float
    ``attn_mask`` of ``scaled_dot_product_attention`` that requires a gradient."""
    import transformers

    config = transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    config.decoder_start_token_id = 0
    return transformers.T5ForConditionalGeneration(config)


class _Exact(Session):
    """``Session(cuda=True)`` without the 512-byte rounding: comparable with real tensors."""

    def _prepare(self, *args: Any, **kwargs: Any) -> None:
        kwargs["round_to"] = 1
        super()._prepare(*args, **kwargs)


def test_t5_is_estimated_on_a_gpu_target() -> None:
    # CUDA runs a bias that requires a gradient through the memory-efficient kernel; the
    # fused CPU kernel the trace stands it in with has no gradient for its mask, so every
    # row was an error ("not differentiable with respect to argument 'attn_mask'").
    result = estimate(
        Stock(t5), token_batch(), targets=["L4-24GB"], micro_batches=[2], largest=False, workers=1
    )
    frame = result.frame()
    assert set(frame["status"]) == {"ok"}, set(frame["reason"].dropna())
    assert bool(frame["fits"].all())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_t5_matches_real_tensors_under_the_cuda_policy(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = token_batch()
    torch.manual_seed(0)
    real = measure_cpu(Stock(t5), batch, micro_batch=4, precision=precision, cuda=True)
    monkeypatch.setattr(grid, "Session", _Exact)
    torch.manual_seed(0)
    traced = trace_configuration(
        Stock(t5), batch, micro_batch=4, precision=precision, device="cuda"
    )
    for phase in PHASE_ORDER:
        assert abs(traced[phase].peak_bytes - real[phase]) <= 0.001 * real[phase], phase


def test_a_learned_attention_bias_gets_the_math_path_gradients() -> None:
    from lightning_pilot.estimate.cuda import cuda_attention

    generator = torch.Generator().manual_seed(0)
    query, key, value = (
        torch.randn(2, 4, n, 8, generator=generator, requires_grad=True) for n in (5, 7, 7)
    )
    bias = torch.randn(1, 4, 5, 7, generator=generator, requires_grad=True)
    weights = torch.randn(2, 4, 5, 8, generator=generator)
    grads = []
    for fused in (False, True):
        with cuda_attention() if fused else torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=bias, scale=0.5
            )
        grads.append(torch.autograd.grad((out * weights).sum(), (query, key, value, bias)))
    for math, fused in zip(*grads, strict=True):
        assert fused.shape == math.shape
        torch.testing.assert_close(fused, math)


def vit() -> Any:
    import transformers

    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=5,
    )
    return transformers.ViTForImageClassification(config)


def test_largest_micro_batch_of_the_default_grid_when_one_runs_other_operators() -> None:
    # The default grid (micro-batch 1) adds 2 and 4 for the search. ViT's training runs other
    # operators at 1 than at 2 (so 4 is traced), its validation does not (so 4 is
    # extrapolated): the search looked for traced validation only and found no pair.
    generator = torch.Generator().manual_seed(0)
    batch = {
        "pixel_values": torch.randn(4, 3, 16, 16, generator=generator),
        "labels": torch.arange(4),
    }
    result = estimate(Stock(vit), batch, targets=["L4-24GB"], workers=1)
    largest = result.largest_frame().iloc[0]
    assert largest["status"] == "ok", largest["reason"]
    assert largest["largest_micro_batch"] >= 1


def bert() -> Any:
    import transformers

    config = transformers.BertConfig(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


def test_largest_sequence_length_up_to_the_position_table() -> None:
    # BERT slices its position and token-type buffers to the length: aten.slice, except at
    # the table's full length (the search's bound), where PyTorch dispatches aten.alias. The
    # three traced lengths then differed by that one view and the search gave up ("the
    # traced sequence lengths ran different operators").
    batch = token_batch(labels=False)
    batch["labels"] = torch.arange(4) % 3
    result = estimate(Stock(bert), batch, targets=["L4-24GB"], seq_lens=[16], workers=1)
    largest = result.largest_frame().iloc[0]
    assert largest["largest_seq_len"] == 64, largest["seq_len_reason"]
    assert bool(largest["seq_len_checked"])


def whisper() -> Any:
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=96,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.WhisperForConditionalGeneration(config)


def test_whisper_sequence_search_stops_at_the_decoders_positions() -> None:
    # Whisper declares its decoder's length as max_target_positions: the search went on to
    # 131,072 tokens and failed ("Labels' sequence length ... cannot exceed ... 32 tokens").
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_features": torch.randn(4, 8, 32, generator=generator),
        "labels": torch.randint(3, 96, (4, 6), generator=generator),
    }
    result = estimate(Stock(whisper), batch, targets=["L4-24GB"], workers=1)
    largest = result.largest_frame().iloc[0]
    assert largest["max_seq_len"] == 32
    assert largest["largest_seq_len"] == 32, largest["seq_len_reason"]


def test_a_factory_builds_a_vit() -> None:
    # ViT initialises its position embeddings with nn.init.trunc_normal_, which (torch 2.13)
    # draws until mask.any() is false: under a factory's fake mode every row was
    # 'untraceable' at setup. Built fake, it gives the live module's rows.
    generator = torch.Generator().manual_seed(0)
    batch = {
        "pixel_values": torch.randn(4, 3, 16, 16, generator=generator),
        "labels": torch.arange(4),
    }
    sizes: dict[str, Any] = {"targets": ["L4-24GB"], "micro_batches": [2], "largest": False}
    built = estimate(factory=lambda: Stock(vit), batch=batch, workers=1, **sizes).frame()
    live = estimate(Stock(vit), batch, workers=1, **sizes).frame()
    assert set(built["status"]) == {"ok"}, set(built["reason"].dropna())
    assert built["peak_allocated_bytes"].tolist() == live["peak_allocated_bytes"].tolist()


@pytest.mark.parametrize("micro_batch", [2, 4, 6])
def test_buffers_and_the_batch_are_counted_once(micro_batch: int) -> None:
    # BERT's integer buffers (position ids, token type ids: 512 bytes each) were counted twice:
    # as buffers and as the real copy of their values a trace reads, made while the recorder
    # ran (+1,024 bytes in every phase). A micro-batch cut from a larger batch was a view of
    # it, so the trace counted the whole batch (+528 bytes at micro-batches 2 and 6).
    batch = token_batch(labels=False)
    batch["labels"] = torch.arange(4) % 3
    torch.manual_seed(0)
    real = measure_cpu(Stock(bert), batch, micro_batch=micro_batch)
    torch.manual_seed(0)
    traced = trace_configuration(Stock(bert), batch, micro_batch=micro_batch)
    for phase in PHASE_ORDER:
        assert abs(traced[phase].peak_bytes - real[phase]) < 256, (
            phase,
            traced[phase].peak_bytes,
            real[phase],
        )


def test_what_is_not_a_lightning_module_is_named() -> None:
    # A plain module was accepted and every row said "'Linear' object has no attribute
    # 'training_step'"; a factory returning None: "'NoneType' object has no attribute
    # 'modules'".
    with pytest.raises(TypeError, match=r"estimate\(module=Linear.*expected a LightningModule"):
        estimate(torch.nn.Linear(4, 4), torch.randn(2, 4))
    rows = estimate(factory=lambda: None, batch=torch.randn(2, 4), largest=False, workers=1)
    (reason,) = set(rows.frame()["reason"])
    assert reason.startswith("TypeError: factory() returned a NoneType: expected a LightningModule")


def test_a_sequence_length_for_a_batch_without_one_is_refused_at_once() -> None:
    # It was an error row naming reshape_batch, after the module was converted.
    images = {"pixel_values": torch.zeros(4, 3, 16, 16), "labels": torch.arange(4)}
    with pytest.raises(
        ValueError, match=r"estimate\(seq_lens=\[32\]\) is invalid: expected \[None\]"
    ):
        estimate(Stock(vit), images, seq_lens=[32])


class Denoiser(LightningModule):
    """A diffusers UNet2DModel learning to predict the noise added to images."""

    def __init__(self) -> None:
        super().__init__()
        import diffusers

        self.model = diffusers.UNet2DModel(
            sample_size=16,
            in_channels=3,
            out_channels=3,
            layers_per_block=1,
            block_out_channels=(16, 32),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=8,
            attention_head_dim=8,
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        noisy = batch["sample"] + batch["noise"]
        predicted = self.model(noisy, batch["timesteps"]).sample
        return torch.nn.functional.mse_loss(predicted, batch["noise"])

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def noise_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images, noise = (torch.randn(4, 3, 16, 16, generator=generator) for _ in range(2))
    return {"sample": images, "noise": noise, "timesteps": torch.tensor([1, 250, 500, 999])}


def test_a_diffusers_unet_checkpoints_its_own_blocks() -> None:
    # checkpointing=True needed checkpoint_classes for a diffusers model ("a module without
    # a Hugging Face model inside"); diffusers switches it on itself, as transformers does.
    batch = noise_batch()
    torch.manual_seed(0)
    real = measure_cpu(Denoiser(), batch, micro_batch=4, checkpointing=True)
    torch.manual_seed(0)
    module = Denoiser()
    before = [vars(m).get("_gradient_checkpointing_func") for m in module.modules()]
    traced = trace_configuration(module, batch, micro_batch=4, checkpointing=True)
    plain = trace_configuration(Denoiser(), batch, micro_batch=4)
    # Switched off again, with the functions the blocks had (none, in most).
    assert not module.model.is_gradient_checkpointing
    assert [vars(m).get("_gradient_checkpointing_func") for m in module.modules()] == before
    for phase in PHASE_ORDER:
        assert abs(traced[phase].peak_bytes - real[phase]) <= 0.02 * real[phase], phase
    kept = traced["forward"].categories["activations"]
    assert kept < 0.5 * plain["forward"].categories["activations"]


def llama_lora() -> Any:
    import peft
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)


def bert_batch() -> dict[str, torch.Tensor]:
    batch = token_batch(labels=False)
    batch["labels"] = torch.arange(4) % 3
    return batch


CONVERTED: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "peft_lora": (lambda: Stock(llama_lora), token_batch),
    "to_bfloat16": (lambda: Stock(bert).to(torch.bfloat16), bert_batch),
}


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_a_factory_may_convert_its_module(name: str) -> None:
    # Module.to on fake parameters swaps tensors, which torch refuses for a tensor the fake
    # mode's memo holds a weak reference to: peft placing its adapters, or a factory's own
    # .to(torch.bfloat16), made every row "_apply(): Couldn't swap Linear.weight".
    build, batch_of = CONVERTED[name]
    sizes: dict[str, Any] = {"micro_batches": [2], "largest": False, "workers": 1}
    built = estimate(factory=build, batch=batch_of(), **sizes).frame()
    live = estimate(build(), batch_of(), **sizes).frame()
    assert set(built["status"]) == {"ok"}, set(built["reason"].dropna())
    assert built["peak_allocated_bytes"].tolist() == live["peak_allocated_bytes"].tolist()
