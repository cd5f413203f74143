"""Per-operator selective activation checkpointing (``checkpointing="selective"``, torchtitan's
``op`` mode: matrix products, every other one, and attention saved, the rest recomputed):
traced on fake tensors, it keeps less than no checkpointing and more than full
checkpointing, and matches a real CPU run with the same policy."""

from __future__ import annotations

import pytest
import torch
from estimate_models import HFCausalLM, token_batch

from lightning_pilot.estimate import Session, measure_cpu

TOLERANCE = 0.001  # 32 bytes apart (a buffer the real run never touches)


def later_update(checkpointing: bool | str) -> tuple[int, int, int]:
    """The traced forward and backward peaks of a later update (the first update's trace plus
    the gradients and optimizer state live throughout, as the estimate derives it), and the
    forward pass's activations."""
    batch = token_batch(length=32)  # real: built before the session's fake mode
    with Session(HFCausalLM("llama"), precision="bf16-mixed") as session:
        train = session.train_phases(batch, micro_batch=4, seq_len=32, checkpointing=checkpointing)
        session.optimizer_phases()
        state = session.measure_state()
    forward = train["forward"].peak_bytes + state["grad"] + state["optimizer_state"]
    backward = train["backward"].peak_bytes + state["optimizer_state"]
    return forward, backward, train["forward"].categories["activations"]


def test_selective_lies_between_none_and_full_and_matches_a_real_run() -> None:
    off, full, selective = (later_update(c) for c in (False, True, "selective"))
    assert full[2] < selective[2] < off[2]
    torch.manual_seed(0)
    real = measure_cpu(
        HFCausalLM("llama"),
        token_batch(length=32),
        micro_batch=4,
        seq_len=32,
        precision="bf16-mixed",
        checkpointing="selective",
    )
    assert abs(selective[0] - real["forward"]) <= TOLERANCE * real["forward"]
    assert abs(selective[1] - real["backward"]) <= TOLERANCE * real["backward"]


def test_checkpointing_choice_is_checked() -> None:
    batch = token_batch()
    with (
        Session(HFCausalLM("llama"), precision="32-true") as session,
        pytest.raises(ValueError, match="checkpointing"),
    ):
        session.train_phases(batch, micro_batch=1, checkpointing="sometimes")
