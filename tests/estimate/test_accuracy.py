"""The estimate on fake tensors against the CPU tensor tracker on real tensors.

``measure_cpu`` runs two real updates and measures the second (a later update), so these tests
also prove the estimate's derivation of a later update (the first traced, the previous
gradients and the optimizer state added) and of the optimizer phases (the training batch
added): within 2 % of the real peak per phase, for every model and precision here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from estimate_models import (
    ConvNet,
    HFCausalLM,
    HFClassifier,
    class_batch,
    image_batch,
    token_batch,
    transformer_batch,
    transformer_module,
)

from lightning_pilot.core.memory import state_bytes
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.estimate import CATEGORIES, PHASE_ORDER, measure_cpu
from lightning_pilot.estimate.grid import trace_configuration

TOLERANCE = 0.02


def demo_batch() -> dict[str, torch.Tensor]:
    data = InstructionDataModule(batch_size=4, max_length=32, seed=0)
    data.setup("fit")
    batch: dict[str, torch.Tensor] = next(iter(data.train_dataloader()))
    return batch


# name -> (module factory, batch factory, micro-batch, sequence length)
CASES: dict[str, tuple[Callable[[], Any], Callable[[], Any], int, int | None]] = {
    "demo_lm": (lambda: TinyCausalLM(max_length=32), demo_batch, 8, 32),
    "gpt2": (lambda: HFCausalLM("gpt2"), token_batch, 4, 32),
    "llama": (lambda: HFCausalLM("llama"), token_batch, 4, 32),
    "bert_classifier": (HFClassifier, class_batch, 4, 24),
    "conv_net": (ConvNet, image_batch, 8, None),
    "lightning_transformer": (transformer_module, transformer_batch, 4, 16),
}


def compare(
    name: str, precision: str, checkpointing: bool = False
) -> tuple[dict[str, int], dict[str, Any]]:
    make, batch_of, micro_batch, seq_len = CASES[name]
    batch = batch_of()
    torch.manual_seed(0)
    real = measure_cpu(
        make(),
        batch,
        micro_batch=micro_batch,
        seq_len=seq_len,
        precision=precision,
        checkpointing=checkpointing,
    )
    torch.manual_seed(0)
    traced = trace_configuration(
        make(),
        batch,
        micro_batch=micro_batch,
        seq_len=seq_len,
        precision=precision,
        checkpointing=checkpointing,
    )
    return real, traced


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_peak_per_phase_within_two_percent(name: str, precision: str) -> None:
    real, traced = compare(name, precision)
    assert set(real) == set(PHASE_ORDER) == set(traced)
    for phase in PHASE_ORDER:
        estimate, measured = traced[phase].peak_bytes, real[phase]
        assert measured > 0
        assert abs(estimate - measured) <= TOLERANCE * measured, (phase, estimate, measured)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_activation_checkpointing_within_two_percent_and_smaller(name: str) -> None:
    real, traced = compare(name, "bf16-mixed", checkpointing=True)
    for phase in PHASE_ORDER:
        assert abs(traced[phase].peak_bytes - real[phase]) <= TOLERANCE * real[phase], phase
    make, batch_of, micro_batch, seq_len = CASES[name]
    # Without checkpointing, traced only (its accuracy is test_peak_per_phase's).
    plain = trace_configuration(
        make(), batch_of(), micro_batch=micro_batch, seq_len=seq_len, precision="bf16-mixed"
    )
    saved = traced["forward"].categories["activations"]
    assert saved < plain["forward"].categories["activations"]


def test_16_mixed_within_two_percent() -> None:
    # float16 autocast: the same machinery as bfloat16's, with its own dtype.
    real, traced = compare("gpt2", "16-mixed")
    for phase in PHASE_ORDER:
        assert abs(traced[phase].peak_bytes - real[phase]) <= TOLERANCE * real[phase], phase


def test_bf16_true_halves_the_weights_and_matches() -> None:
    real, traced = compare("demo_lm", "bf16-true")
    for phase in PHASE_ORDER:
        assert abs(traced[phase].peak_bytes - real[phase]) <= TOLERANCE * real[phase], phase
    _, full = compare("demo_lm", "32-true")
    params = traced["checkpoint_save"].categories["param"]
    assert params * 2 == full["checkpoint_save"].categories["param"]


def test_categories_add_up_and_name_the_state() -> None:
    module = TinyCausalLM(max_length=32)
    expected = state_bytes(module)
    traced = trace_configuration(module, demo_batch(), micro_batch=8, seq_len=32)
    for phase in PHASE_ORDER:
        trace = traced[phase]
        assert sum(trace.categories[name] for name in CATEGORIES) == trace.peak_bytes, phase
        assert trace.categories["param"] == expected.param_bytes, phase
        assert trace.categories["buffer"] == expected.buffer_bytes, phase
    save = traced["checkpoint_save"].categories
    assert save["grad"] == expected.param_bytes
    assert save["optimizer_state"] >= 2 * expected.param_bytes  # AdamW: two moments, steps
    forward = traced["forward"].categories
    assert forward["activations"] > forward["temporaries"] > 0
    assert traced["optimizer_step"].categories["activations"] == 0


def test_a_batch_of_the_traced_size_is_not_reshaped_and_still_matches() -> None:
    # The batch already has the micro-batch's rows: reshape_batch hands back the caller's own
    # tensors. The reference must own its copy (the caller keeps the batch alive through
    # validation and the save, which the tracker would count).
    batch = image_batch(rows=8)
    torch.manual_seed(0)
    real = measure_cpu(ConvNet(), batch, micro_batch=8)
    torch.manual_seed(0)
    traced = trace_configuration(ConvNet(), batch, micro_batch=8)
    for phase in PHASE_ORDER:
        estimate, measured = traced[phase].peak_bytes, real[phase]
        assert abs(estimate - measured) <= TOLERANCE * measured, (phase, estimate, measured)
