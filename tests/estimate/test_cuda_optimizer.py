"""The optimizer step as the module asked for it: the notes name the implementation that was
traced, and each implementation's temporaries are what the trace sees (``foreach``: a whole
group's at once, CUDA's default when unset; ``fused``: none; for-loop: one parameter's)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_pilot.demo import TinyCausalLM
from lightning_pilot.estimate import PhaseTrace, Session


class Tuned(TinyCausalLM):
    def __init__(self, **options: Any) -> None:
        super().__init__(max_length=32)
        self.options = options

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, **self.options)


def step(**options: Any) -> tuple[PhaseTrace, int]:
    module = Tuned(**options)
    largest = max(p.numel() * 4 for p in module.parameters())
    with Session(module, precision="32-true", cuda=True) as session:
        return session.optimizer_phases()["optimizer_step"], largest


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({}, "foreach implementation (PyTorch's default on CUDA"),
        ({"foreach": True}, "foreach implementation (as configure_optimizers asked)"),
        ({"foreach": False}, "for-loop implementation (as configure_optimizers asked)"),
        ({"fused": True}, "fused implementation (as configure_optimizers asked)"),
    ],
)
def test_notes_name_the_traced_implementation(options: dict[str, Any], named: str) -> None:
    trace, _ = step(**options)
    assert any(named in note for note in trace.notes), trace.notes


def test_each_implementation_has_its_own_temporaries() -> None:
    foreach, largest = step()
    loop, _ = step(foreach=False)
    fused, _ = step(fused=True)
    transient = {
        name: trace.peak_bytes - trace.start_bytes
        for name, trace in (("foreach", foreach), ("loop", loop), ("fused", fused))
    }
    assert transient["fused"] == 0
    # One parameter at a time: AdamW's for-loop holds two temporaries of the largest
    # parameter (exp_avg_sq.sqrt() and its quotient) and a few scalars.
    assert 2 * largest <= transient["loop"] <= 2 * largest + 4096
    assert transient["foreach"] > 3 * transient["loop"]  # every parameter's at once
