"""The grid: extrapolation checked against traces, rows, strategies, the largest micro-batch,
untraceable steps, bad arguments, no trace on the module, and the Parquet output."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from estimate_models import ConvNet, HFCausalLM, image_batch, token_batch
from torch.utils.flop_counter import FlopCounterMode

from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.estimate import (
    PHASE_ORDER,
    TARGETS,
    Session,
    Strategy,
    Target,
    UntraceableError,
    estimate,
    reshape_batch,
)
from lightning_pilot.estimate.grid import trace_configuration
from lightning_pilot.schemas import ESTIMATE_SCHEMA, LARGEST_SCHEMA
from lightning_pilot.vocabulary import phase_label


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    data = InstructionDataModule(batch_size=4, max_length=32, seed=0)
    data.setup("fit")
    first: dict[str, torch.Tensor] = next(iter(data.train_dataloader()))
    return first


def test_extrapolated_micro_batches_match_traced_ones(batch: Any) -> None:
    result = estimate(
        TinyCausalLM(max_length=32),
        batch,
        targets=["L4-24GB"],
        micro_batches=[2, 4, 16],
        seq_lens=[32],
        largest=False,
    )
    frame = result.frame()
    at_16 = frame[frame.micro_batch == 16]
    labels = [phase_label(p, f) for p, f in zip(at_16.phase, at_16["first"], strict=True)]
    at_16 = at_16.set_index(pd.Index(labels))
    assert at_16.loc["forward", "method"] == "extrapolated"
    # Validation's peak moves to another operator (the logits outgrow the rest) by 16: then
    # the extrapolation refuses and the grid traces it.
    assert at_16.loc["validation", "method"] in ("extrapolated", "traced")
    traced = trace_configuration(
        TinyCausalLM(max_length=32),
        batch,
        micro_batch=16,
        seq_len=32,
        precision="bf16-mixed",
        device="cuda",
    )
    workspace = TARGETS["L4-24GB"].workspace_bytes
    for phase in PHASE_ORDER:
        expected = traced[phase].peak_bytes
        got = int(at_16.loc[phase, "peak_allocated_bytes"]) - workspace
        # Exact but for the 512-byte rounding of small storages (not linear in the size).
        assert abs(got - expected) <= 0.005 * expected, (phase, got, expected)
    forward = at_16.loc["forward"]
    assert int(forward["flops_per_update"]) == sum(
        int(traced[p].flops.sum()) for p in ("forward", "backward", "optimizer_step")
    )


def test_rows_fit_headroom_and_time_band(batch: Any) -> None:
    tiny = Target(
        "tiny",
        memory="12MiB",
        fp32=1e12,
        tf32=1e12,
        bf16=2e12,
        fp16=2e12,
        bandwidth=1e11,
        overhead_bytes=0,
        workspace_bytes=0,
    )
    result = estimate(
        TinyCausalLM(max_length=32),
        batch,
        targets=[tiny, "H100-SXM-80GB"],
        micro_batches=[1, 64],
        seq_lens=[32],
        largest=False,
    )
    frame = result.frame()
    assert len(frame) == 2 * 2 * len(PHASE_ORDER)
    assert set(frame.status) == {"ok"}
    on_tiny = frame[frame.target == "tiny"]
    assert not on_tiny[on_tiny.micro_batch == 64].fits.all()
    assert on_tiny[on_tiny.micro_batch == 1].fits.all()
    # Headroom is what the live blocks leave: between what reserved and allocated leave.
    free = frame.gpu_memory_bytes - frame.overhead_bytes
    assert (frame.headroom_bytes >= free - frame.peak_reserved_bytes).all()
    assert (frame.headroom_bytes <= free - frame.peak_allocated_bytes).all()
    assert (frame.peak_reserved_bytes >= frame.peak_allocated_bytes).all()
    assert (frame.step_time_low_s < frame.step_time_high_s).all()
    # Both efficiency ranges are 0.40 to 0.85 by default: the band's ends differ by 0.85/0.40.
    ratio = (frame.step_time_high_s / frame.step_time_low_s).round(6)
    assert ratio.eq(round(0.85 / 0.40, 6)).all()
    h100 = frame[(frame.target == "H100-SXM-80GB") & (frame.micro_batch == 64)].iloc[0]
    slow = frame[(frame.target == "tiny") & (frame.micro_batch == 64)].iloc[0]
    assert h100.step_time_low_s < slow.step_time_low_s


def test_strategies_ddp_adds_buckets_fsdp_shards(batch: Any) -> None:
    result = estimate(
        HFCausalLM("llama"),
        token_batch(),
        micro_batches=[2],
        seq_lens=[32],
        strategies=["single", "ddp:4", Strategy("ddp", 4, bucket_view=True), "fsdp:4"],
        largest=False,
        workers=1,
    )
    frame = result.frame()
    opt = frame[frame.phase == "checkpoint_save"].set_index(["strategy", "analytic_bytes"])
    rows = frame[frame.phase == "checkpoint_save"]
    single = rows[rows.strategy == "single"].iloc[0]
    ddp = rows[(rows.strategy == "ddp")].sort_values("peak_allocated_bytes")
    assert ddp.iloc[0].peak_allocated_bytes == single.peak_allocated_bytes  # bucket view
    assert ddp.iloc[1].peak_allocated_bytes == single.peak_allocated_bytes + single.grad_bytes
    fsdp = rows[rows.strategy == "fsdp"].iloc[0]
    assert fsdp.peak_allocated_bytes < single.peak_allocated_bytes
    assert "analytic: FSDP" in fsdp.notes
    assert len(opt) == 4


def test_largest_micro_batch_is_checked_by_tracing(batch: Any) -> None:
    small = Target(
        "small",
        memory="6MiB",
        fp32=1e12,
        tf32=1e12,
        bf16=2e12,
        fp16=2e12,
        bandwidth=1e11,
        overhead_bytes=0,
        workspace_bytes=0,
    )
    result = estimate(
        TinyCausalLM(max_length=32),
        batch,
        targets=[small],
        precisions=["32-true"],
        micro_batches=[1, 2],
        seq_lens=[32],
    )
    (row,) = result.largest
    assert row["status"] == "ok"
    assert row["checked"] is True
    largest = row["largest_micro_batch"]
    assert largest >= 2
    # The grid's rows agree: the largest fits, twice as many does not. (Right at the boundary
    # the two may differ by the packing of small blocks into 2 MiB segments: a session that
    # already holds the optimizer state packs them otherwise.)
    fits = estimate(
        TinyCausalLM(max_length=32),
        batch,
        targets=[small],
        precisions=["32-true"],
        micro_batches=[largest, 2 * largest],
        seq_lens=[32],
        largest=False,
    ).frame()
    worst = fits.groupby("micro_batch").fits.all()
    assert bool(worst[largest])
    assert not bool(worst[2 * largest])
    # The largest sequence length at the smallest micro-batch, bounded by the module's
    # max_length (32), found by the quadratic of three traced lengths and confirmed by
    # tracing it (fits) and the next step (does not, unless at the bound).
    assert row["seq_len_micro_batch"] == 1
    assert row["max_seq_len"] == 32
    assert row["seq_len_checked"] is True
    assert row["seq_len_method"].endswith("traced") or "corrected" in row["seq_len_method"]
    assert 0 < row["largest_seq_len"] <= 32


class ReadsTheLoss(TinyCausalLM):
    """A training step that reads a float back (``loss.item()``): untraceable."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 100:
            raise RuntimeError("diverged")
        return loss


class SelectsLogits(TinyCausalLM):
    """``nonzero`` on the model's output: a data-dependent shape."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        return logits[logits > 0].sum()


@pytest.mark.parametrize(
    ("cls", "op"), [(ReadsTheLoss, "_local_scalar_dense"), (SelectsLogits, "nonzero")]
)
def test_untraceable_step_gives_a_named_row(batch: Any, cls: type, op: str) -> None:
    result = estimate(cls(max_length=32), batch, micro_batches=[2], seq_lens=[32])
    (row,) = result.rows
    assert row["status"] == "untraceable"
    assert row["phase"] == "forward"
    assert op in row["reason"]
    assert "fake tensor" in row["reason"]
    assert row.get("peak_allocated_bytes") is None
    assert result.largest[0]["status"] == "untraceable"
    with pytest.raises(UntraceableError, match=op):
        trace_configuration(cls(max_length=32), batch, micro_batch=2, seq_len=32)


def test_batch_values_read_back_are_traced(batch: Any) -> None:
    # The demo LM's loss divides by int(mask.sum()) over the labels: the real values travel
    # with the fake batch, so the step traces.
    rows = estimate(
        TinyCausalLM(max_length=32), batch, micro_batches=[3], seq_lens=[32], largest=False
    ).rows
    assert {row["status"] for row in rows} == {"ok"}


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"precisions": ["fp8"]}, ValueError, "estimate(precisions='fp8') is invalid"),
        ({"micro_batches": [0]}, ValueError, "estimate(micro_batches=0) is invalid"),
        ({"micro_batches": 4}, TypeError, "estimate(micro_batches=4) is invalid: expected a list"),
        ({"targets": ["B200"]}, ValueError, "estimate(targets='B200') is invalid"),
        ({"strategies": ["ddp:x"]}, ValueError, "'single', 'ddp:N' or 'fsdp:N'"),
        ({"seq_lens": [-1]}, ValueError, "estimate(seq_lens=-1) is invalid"),
        ({"checkpointing": ["yes"]}, ValueError, "estimate(checkpointing='yes') is invalid"),
        ({"checkpointing": [1]}, TypeError, "estimate(checkpointing=1) is invalid"),
        ({"efficiency": (0.9, 0.1)}, ValueError, "estimate(efficiency=(0.9, 0.1)) is invalid"),
        ({"checkpoint_classes": [int]}, TypeError, "torch.nn.Module subclasses"),
    ],
)
def test_bad_arguments_fail_early_and_clearly(
    batch: Any, kwargs: dict[str, Any], error: type, text: str
) -> None:
    with pytest.raises(error, match=None) as info:
        estimate(TinyCausalLM(max_length=32), batch, **kwargs)
    assert text in str(info.value)


def test_bad_target_and_module_arguments() -> None:
    with pytest.raises(ValueError, match=r"Target\(bandwidth=0\) is invalid"):
        Target("x", memory="1GiB", fp32=1, tf32=1, bf16=1, fp16=1, bandwidth=0)
    with pytest.raises(ValueError, match="not a size"):
        Target("x", memory="lots", fp32=1, tf32=1, bf16=1, fp16=1, bandwidth=1)
    with pytest.raises(ValueError, match=r"estimate\(module=None\) is invalid"):
        estimate(None, {"x": torch.ones(1)})
    with pytest.raises(ValueError, match=r"reshape_batch\(seq_len=8\) is invalid"):
        reshape_batch({"x": torch.ones(2, 3)}, 2, 8)


def _snapshot(module: torch.nn.Module) -> dict[str, Any]:
    return {
        "params": [(n, p, p.dtype, p.requires_grad, p.grad) for n, p in module.named_parameters()],
        "buffers": [(n, b) for n, b in module.named_buffers()],
        "training": [m.training for m in module.modules()],
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in module.modules()
        ],
        "dicts": [sorted(vars(m)) for m in module.modules()],
        "checkpointing": [getattr(m, "gradient_checkpointing", None) for m in module.modules()],
    }


def test_no_trace_on_a_live_module() -> None:
    module = HFCausalLM("llama")
    module.eval()
    module.model.model.layers[0].train()
    before = _snapshot(module)
    result = estimate(
        module,
        token_batch(),
        precisions=["bf16-true"],  # parameters converted and given back
        micro_batches=[2],
        seq_lens=[16],
        checkpointing=[False, True],
        largest=False,
    )
    assert {row["status"] for row in result.rows} == {"ok"}
    after = _snapshot(module)
    for key, value in before.items():
        if key in ("params", "buffers"):
            assert [item[1] for item in after[key]] == [item[1] for item in value]
            assert all(
                a is b
                for a, b in zip([i[1] for i in after[key]], [i[1] for i in value], strict=True)
            )
        assert after[key] == value if key not in ("params", "buffers") else True, key
    assert not module.model.is_activation_checkpointing
    # The module still trains for real afterwards.
    loss = module.training_step(token_batch(), 0)
    assert torch.isfinite(loss)


def test_no_trace_with_checkpoint_classes_and_cached_tensors() -> None:
    from estimate_models import transformer_batch, transformer_module

    module = transformer_module()
    layer_cls = type(module.model.transformer.encoder.layers[0])
    before = _snapshot(module)
    estimate(
        module,
        transformer_batch(),
        micro_batches=[2],
        seq_lens=[12],
        checkpointing=[True],
        checkpoint_classes=[layer_cls],
        largest=False,
    )
    assert _snapshot(module)["dicts"] == before["dicts"]
    assert module.model.src_mask is None
    assert "forward" not in vars(module.model.transformer.encoder.layers[0])


def test_parquet_output_through_storage(batch: Any, tmp_path: Path) -> None:
    result = estimate(
        TinyCausalLM(max_length=32),
        batch,
        micro_batches=[1, 2],
        seq_lens=[32],
        largest=False,  # the largest table is written all the same (no rows)
        out_dir=tmp_path / "estimate",
    )
    assert len(result.paths) == 2
    table = pq.read_table(result.paths[0])
    assert table.schema.names == ESTIMATE_SCHEMA.names
    frame = pd.read_parquet(result.paths[0])
    assert len(frame) == len(result.rows) == 2 * len(PHASE_ORDER)
    assert pq.read_table(result.paths[1]).schema.names == LARGEST_SCHEMA.names
    with pytest.raises(FileExistsError):
        estimate(
            TinyCausalLM(max_length=32),
            batch,
            micro_batches=[1],
            seq_lens=[32],
            largest=False,
            out_dir=tmp_path / "estimate",
        )


def test_flops_agree_with_flop_counter_mode() -> None:
    module = ConvNet()
    data = reshape_batch(image_batch(), 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counter = FlopCounterMode(display=False)
        with counter:
            loss = module.training_step(data, 0)["loss"]
            loss.backward()
    expected = counter.get_total_flops()
    with Session(ConvNet()) as session:
        traced = session.train_phases(image_batch(), micro_batch=8)
    assert expected > 0
    assert int(traced["forward"].flops.sum() + traced["backward"].flops.sum()) == expected


def test_cuda_attention_saves_no_attention_matrix() -> None:
    # GPT-2's attention dropout sends CPU attention to the math path (T x T matrices saved);
    # CUDA's fused kernels save none: the "cuda" trace models them.
    batch = token_batch(length=32)
    cpu = trace_configuration(HFCausalLM("gpt2"), batch, micro_batch=4, seq_len=64)
    cuda = trace_configuration(HFCausalLM("gpt2"), batch, micro_batch=4, seq_len=64, device="cuda")
    assert (
        torch.nn.functional.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"
    )
    # Per layer, the math path saves B x H x T x T floats several times over.
    attention_matrix = 4 * 2 * 64 * 64 * 4
    saved = cpu["forward"].categories["activations"] - cuda["forward"].categories["activations"]
    assert saved >= 2 * 2 * attention_matrix


def test_largest_search_stops_at_max_micro_batch(batch: Any) -> None:
    result = estimate(
        TinyCausalLM(max_length=32),
        batch,
        targets=["H200-SXM-141GB"],
        micro_batches=[2, 4],
        seq_lens=[32],
        max_micro_batch=64,
        workers=1,
    )
    (row,) = result.largest
    assert row["largest_micro_batch"] == 64
    assert row["checked"] is False
    assert "max_micro_batch=64" in row["reason"]


_AFTER_OPENMP = """
import torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
for _ in range(3):
    (a @ a).sum()  # OpenMP's thread pool now exists in this process
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.estimate import estimate
data = InstructionDataModule(batch_size=4, max_length=32, seed=0)
data.setup("fit")
batch = next(iter(data.train_dataloader()))
result = estimate(TinyCausalLM(max_length=32), batch, targets=["L4-24GB"],
                  precisions=["bf16-mixed", "32-true"], micro_batches=[2], seq_lens=[32],
                  largest=False, workers=2)
print("rows", len(result.rows))
"""


def test_workers_after_an_openmp_parallel_operator_finish() -> None:
    """A parent that ran a multi-threaded operator forks workers that finish."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", _AFTER_OPENMP], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rows 12" in done.stdout


class _Slow(TinyCausalLM):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        import time

        time.sleep(30)
        return super().training_step(batch, batch_idx)


def test_workers_past_the_timeout_stop_with_a_clear_error(batch: Any) -> None:
    import time

    started = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"estimate\(timeout=1.0\).*workers=1"):
        estimate(
            _Slow(max_length=32),
            batch,
            precisions=["bf16-mixed", "32-true"],
            micro_batches=[2],
            seq_lens=[32],
            largest=False,
            workers=2,
            timeout=1.0,
        )
    assert time.perf_counter() - started < 20


def test_fsdp_mixed_precision_computes_in_bf16_without_autocast_copies() -> None:
    """FSDP under bf16-mixed follows FSDP's MixedPrecision(param_dtype=bf16): the batch's
    phases as bf16-true traces them (no autocast copies of the weights), the sharded state
    in float32; DDP keeps autocast."""
    result = estimate(
        HFCausalLM("llama"),
        token_batch(),
        precisions=["bf16-mixed", "bf16-true"],
        micro_batches=[2],
        seq_lens=[32],
        checkpointing=[False, True],
        strategies=["single", "fsdp:1", "fsdp:4"],
        largest=False,
        workers=1,
    )
    frame = result.frame()
    keys = ["precision", "strategy", "devices", "checkpointing", "phase", "first"]
    rows = frame.set_index(keys)
    params = sum(p.numel() for p in HFCausalLM("llama").parameters())
    for ckpt in (False, True):
        mixed = rows.loc[("bf16-mixed", "single", 1, ckpt, "forward", False)]
        true = rows.loc[("bf16-true", "single", 1, ckpt, "forward", False)]
        fsdp = rows.loc[("bf16-mixed", "fsdp", 1, ckpt, "forward", False)]
        # The activations and temporaries are bf16-true's: autocast's bf16 copies of the
        # weights (held by its cache through the forward pass) are gone ...
        assert fsdp.activations_bytes == true.activations_bytes
        assert fsdp.temporaries_bytes == true.temporaries_bytes
        assert mixed.activations_bytes + mixed.temporaries_bytes > (
            true.activations_bytes + true.temporaries_bytes
        )
        # ... while the weights, gradients and optimizer state stay float32.
        assert fsdp.param_bytes == mixed.param_bytes
        assert fsdp.buffer_bytes == mixed.buffer_bytes
        assert fsdp.optimizer_state_bytes == mixed.optimizer_state_bytes >= 8 * params
        assert "param_dtype=bf16" in fsdp.notes
        sharded = rows.loc[("bf16-mixed", "fsdp", 4, ckpt, "forward", False)]
        assert sharded.peak_allocated_bytes < fsdp.peak_allocated_bytes
    # bf16-true's own FSDP rows and DDP are unchanged: no policy note.
    assert "param_dtype" not in rows.loc[("bf16-true", "fsdp", 4, False, "forward", False)].notes
    assert "param_dtype" not in rows.loc[("bf16-mixed", "single", 1, False, "forward", False)].notes
    # FSDP steps the optimizer on each GPU's shard: its temporaries are divided too.
    step = rows.loc[("bf16-mixed", "fsdp", 4, False, "optimizer_step", False)]
    single_step = rows.loc[("bf16-mixed", "single", 1, False, "optimizer_step", False)]
    own = step.peak_allocated_bytes - step.workspace_bytes
    assert own < (single_step.peak_allocated_bytes - single_step.workspace_bytes) / 2


class _OneCycle(TinyCausalLM):
    """The OneCycleLR idiom: the schedule's length from the Trainer."""

    def __init__(self, reads: str = "estimated_stepping_batches", **opt: Any) -> None:
        super().__init__(max_length=32)
        self.reads, self.opt = reads, opt

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, **self.opt)
        steps = getattr(self.trainer, self.reads)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-3, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}


@pytest.mark.parametrize(
    ("opt", "says"),
    [
        ({}, "foreach implementation"),
        ({"foreach": False}, "for-loop implementation"),
        ({"fused": True}, "fused implementation"),
    ],
)
def test_one_cycle_without_a_trainer_and_the_optimizer_named(
    batch: Any, opt: dict[str, Any], says: str
) -> None:
    module = _OneCycle(**opt)
    result = estimate(module, batch, micro_batches=[2], seq_lens=[32], largest=False, workers=1)
    assert {row["status"] for row in result.rows} == {"ok"}
    step = next(row for row in result.rows if row["phase"] == "optimizer_step" and row["first"])
    assert f"optimizer: AdamW, {says}" in step["notes"]
    assert "estimated_stepping_batches=1000" in step["notes"]
    assert module._trainer is None  # the stand-in is gone


def test_configure_optimizers_failing_names_its_phase_and_a_remedy(batch: Any) -> None:
    result = estimate(
        _OneCycle("datamodule"), batch, micro_batches=[2], seq_lens=[32], largest=False, workers=1
    )
    (row,) = result.rows
    assert row["status"] == "error"
    assert (row["phase"], row["first"]) == ("optimizer_step", True)
    assert "configure_optimizers() failed: AttributeError: trainer.datamodule" in row["reason"]
    assert "TargetEstimator" in row["reason"]


def test_selective_checkpointing_sits_between_none_and_full(batch: Any, tmp_path: Path) -> None:
    result = estimate(
        HFCausalLM("llama"),
        token_batch(),
        precisions=["bf16-mixed"],
        micro_batches=[2],
        seq_lens=[32],
        checkpointing=[False, True, "selective"],
        largest=False,
        workers=1,
        out_dir=tmp_path,
    )
    frame = result.frame()
    backward = frame[frame.phase == "backward"].set_index("checkpointing")
    assert set(frame["status"]) == {"ok"}
    none, full, selective = (
        backward.loc[k, "activations_bytes"] for k in (False, True, "selective")
    )
    assert full < selective < none
    # The Parquet column names the mode: off, full or selective, one row per phase each.
    written = pd.read_parquet(result.paths[0])
    assert written.checkpointing.value_counts().to_dict() == {
        "off": 6,
        "full": 6,
        "selective": 6,
    }
    with pytest.raises(ValueError, match=r"checkpointing='some'\) is invalid"):
        estimate(HFCausalLM("llama"), token_batch(), checkpointing=["some"], largest=False)


def test_fits_rests_on_live_blocks_not_on_the_reserved_cache() -> None:
    """The estimate of torchtitan's Llama 2 13B without checkpointing over 64 A100 80GB, its
    backward: 79.21 GiB allocated, 79.34 GiB of live segments, 83.31 GiB reserved with the 5 %
    fragmentation allowance. On a GPU of 80 GiB (the datasheet's figure) the live blocks fit
    and the reserved estimate does not: the allocator frees its cache and retries cudaMalloc
    before raising out-of-memory, so only the live blocks count: it fits, with a tight note.
    An A100 80GB reports less, 79.15 GiB: there the live blocks alone do not fit
    (docs/estimate-validation.md). LitGPT's Llama 2 13B LoRA at 2 x 1,304 tokens on an
    A100 40GB ran out of memory: 44.22 GiB allocated does not fit in 40 GiB."""
    from lightning_pilot.estimate import fits

    gib = 2**30
    a100 = TARGETS["A100-SXM-80GB"]
    nominal = Target(
        "A100 at 80 GiB",
        memory=80 * gib,
        fp32=a100.fp32,
        tf32=a100.tf32,
        bf16=a100.bf16,
        fp16=a100.fp16,
        bandwidth=a100.bandwidth,
    )
    allocated, live, reserved = int(79.21 * gib), int(79.34 * gib), int(83.31 * gib)
    need = fits.need(allocated, live - nominal.workspace_bytes, nominal)
    assert need == live + nominal.overhead_bytes <= nominal.memory_bytes
    assert reserved + nominal.overhead_bytes > nominal.memory_bytes  # the rule it replaces
    note = fits.tight_note(reserved, nominal)
    assert note.startswith("tight: the estimated reserved 83.31 GiB plus 0.50 GiB overhead")
    assert fits.need(allocated, live - a100.workspace_bytes, a100) > a100.memory_bytes
    small = TARGETS["A100-40GB"]
    allocated = int(44.22 * gib)
    assert fits.need(allocated, allocated, small) > small.memory_bytes
    # Never less than the peak allocated, even when the segments were under-counted.
    assert fits.need(allocated, 0, small) == allocated + small.overhead_bytes


def test_roofline_of_one_bf16_operator_on_an_h100() -> None:
    from lightning_pilot.estimate.roofline import split_seconds

    compute, memory = split_seconds(
        np.array([10**12]), np.array([10**6]), np.array([2]), TARGETS["H100-SXM-80GB"]
    )
    assert (round(compute * 1000, 3), memory) == (1.011, 0.0)  # 1 TFLOP at 989.5 TFLOP/s


def test_grid_job_holds_the_checked_arguments() -> None:
    from lightning_pilot.estimate.job import GridJob, check_arguments

    job = GridJob(batch={}, **check_arguments("estimate", {"micro_batches": [8, 2, 4]}))
    assert (job.micro_batches, job.search_base) == ((8, 2, 4), (2, 4))
    job = GridJob(batch={}, micro_batches=(1, 2, 4), strategies=(Strategy("fsdp", 8),))
    assert (job.search_base, job.traced) == ((2, 4), ("bf16-mixed", "bf16-true"))
    assert GridJob(batch={}, micro_batches=(1, 8)).search_base == (2, 4)
    checked = check_arguments("estimate", {"strategies": ["ddp:2"], "largest": False})
    assert checked == {"strategies": (Strategy("ddp", 2),), "largest": False}


def test_settle_corrects_a_prediction_by_tracing_and_the_sequence_bound() -> None:
    from lightning_pilot.estimate.searches import sequence_bound, settle

    assert settle(lambda b: b <= 37, 40, 1024) == (37, True)
    assert sequence_bound(TinyCausalLM(max_length=32)) == 32


def test_fsdp_units_nest_bottom_up() -> None:
    """A unit inside a unit is its own group: the outer one holds only what is left (torch's
    ``fully_shard`` groups ``module.parameters()`` less those of units wrapped before it)."""
    from lightning_pilot.estimate.strategies import unit_bytes

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(10, 10)  # 110 parameters

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()
            self.norm = torch.nn.LayerNorm(10)  # 20 parameters

    model = torch.nn.Sequential(Outer(), Outer(), torch.nn.Linear(10, 1))  # head: 11
    assert unit_bytes(model, (Outer, Inner), 2) == (110 * 2, 11 * 2)
    assert unit_bytes(model, (Outer,), 2) == (130 * 2, 11 * 2)
    assert unit_bytes(model, ("Inner",), 4) == (110 * 4, (2 * 20 + 11) * 4)
    assert unit_bytes(model, (), 4) == (271 * 4, 0)  # no unit: the whole module is one


def test_checkpointed_blocks_take_any_keyword() -> None:
    """A block under ``checkpoint_classes`` is called with its own keywords, whatever their
    names, and gets its forward back after."""
    from lightning_pilot.estimate.checkpointing import activation_checkpointing

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, selective: float = 1.0) -> torch.Tensor:
            return self.linear(x) * selective

    model = torch.nn.Sequential(Block())
    x = torch.ones(2, 4, requires_grad=True)
    expected = model[0](x, selective=2.0)
    with activation_checkpointing(model, (Block,), selective=True) as how:
        assert how.startswith("torch.utils.checkpoint around Block, selective per operator")
        assert "forward" in model[0].__dict__
        torch.testing.assert_close(model[0](x, selective=2.0), expected)
    assert "forward" not in model[0].__dict__
