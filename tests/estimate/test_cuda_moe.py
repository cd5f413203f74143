"""A stock mixture of experts (``transformers.MixtralForCausalLM``) is estimated under a stated
routing assumption: a router's ``topk`` over the model's floats cannot be known on fake
tensors, so the trace routes tokens evenly (each expert gets tokens x top-k / experts) and the
rows say so. A real CPU run routed the same way (``measure_cpu(balanced_routing=True)``) is
the reference."""

from __future__ import annotations

import pytest
import torch
from estimate_models import HFMixtral, token_batch

from lightning_pilot.estimate import PHASE_ORDER, Session, estimate, measure_cpu
from lightning_pilot.estimate.grid import trace_configuration
from lightning_pilot.estimate.routing import BalancedRouting, balanced_routes


@pytest.mark.parametrize("experts", [None, "eager"])
def test_mixtral_rows_name_the_routing(experts: str | None) -> None:
    result = estimate(
        HFMixtral(experts),
        token_batch(),
        targets=["H100-SXM-80GB"],
        precisions=["bf16-mixed"],
        micro_batches=[2],
        seq_lens=[16],
        largest=False,
        workers=1,
    )
    frame = result.frame()
    assert list(frame["status"]) == ["ok"] * len(PHASE_ORDER), frame["reason"].tolist()
    forward = frame[frame["phase"] == "forward"].iloc[0]
    assert "routing: assumed, balanced" in forward["notes"]
    assert "top-2 of 4 experts" in forward["notes"]
    assert forward["peak_allocated_bytes"] > 0
    assert forward["flops_per_update"] > 0


@pytest.mark.parametrize("experts", [None, "eager"])
def test_mixtral_memory_equals_a_real_run_routed_the_same_way(experts: str | None) -> None:
    batch = token_batch()
    torch.manual_seed(0)
    real = measure_cpu(
        HFMixtral(experts),
        batch,
        micro_batch=4,
        seq_len=16,
        precision="bf16-mixed",
        balanced_routing=True,
    )
    torch.manual_seed(0)
    traced = trace_configuration(
        HFMixtral(experts), batch, micro_batch=4, seq_len=16, precision="bf16-mixed"
    )
    for phase in PHASE_ORDER:
        # 32 bytes apart in every phase (a buffer the real run never touches): 0.1 % here.
        assert abs(traced[phase].peak_bytes - real[phase]) <= 0.001 * real[phase], (
            phase,
            traced[phase].peak_bytes,
            real[phase],
        )


def test_balanced_routes_give_every_expert_its_share() -> None:
    assert balanced_routes((4, 4), 2).tolist() == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert balanced_routes((6, 4), 2).flatten().bincount().tolist() == [3, 3, 3, 3]
    loaded = balanced_routes((8, 4), 2, capacity_factor=2.0)
    assert loaded.flatten().bincount().tolist() == [8, 3, 3, 2]
    with BalancedRouting():
        assert torch.randn(4, 4).topk(2).indices.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_capacity_factor_loads_the_busiest_expert() -> None:
    routes = balanced_routes((64, 8), 2, capacity_factor=2.0)
    load = routes.flatten().bincount(minlength=8).tolist()
    assert load[0] == 32  # 2 x 64 x 2 / 8
    assert sum(load) == 128
    assert all((row[0] != row[1]).item() for row in routes)  # distinct experts per token
    with pytest.raises(ValueError, match="capacity_factor"):
        Session(HFMixtral(), capacity_factor=0.5)
