"""The estimate against published, measured GPU runs (``docs/estimate-validation.md``; the
whole table: ``python benchmarks/estimate_validation.py``). A few of its runs, the cheapest
to trace of each kind: a memory figure, a published out-of-memory, a step time that did not
calibrate the band, and the run that ran which the estimate calls out of memory with the
transformers Llama's un-fused norm (a known failure here) and fits with the fused norm its
source then named."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import estimate_validation as validation

RUNS = {run.name: run for run in validation.RUNS}


@functools.cache
def _compared(name: str) -> dict[str, Any]:
    run = RUNS[name]
    return validation.compare(run, validation.estimate_run(run))


@pytest.mark.parametrize(
    "name", ["litgpt-phi15-lora-mb1", "litgpt-phi15-lora-mb4", "titan-h100-llama31-8b-sac"]
)
def test_published_memory_within_ten_percent(name: str) -> None:
    row = _compared(name)
    assert row["no_false_oom"]
    assert 0.9 <= row["memory_ratio"] <= 1.1, row


def test_published_out_of_memory_is_predicted() -> None:
    """LitGPT's Llama 2 7B LoRA at 4 x 1,304 tokens ran out of memory on an A100-SXM4-40GB.
    The estimate's backward needs its live blocks plus the 0.5 GiB overhead, 39.62 GiB: more
    than the 39.39 GiB the card reports (deviceQuery: 42,298,834,944 bytes), less than the
    datasheet's 40 GiB."""
    row = _compared("litgpt-llama2-7b-lora-mb4")
    assert row["published_memory"] == "OOM"
    assert row["gpu_memory_gib"] == 39.39
    assert row["oom_predicted"], row
    assert -1.0 < row["headroom_gib"] < 0, row  # over the reported memory, under the nominal


def test_the_calibration_run_without_checkpointing_is_in_the_band() -> None:
    row = _compared("titan-llama2-13b-noac")
    assert row["role"] == "calibrate"
    assert row["in_band"], row


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known miss (docs/estimate-validation.md): torchtitan's Llama 2 13B without"
    " checkpointing, 2 x 4,096 over 64 A100 80GB, ran; with the transformers Llama's un-fused"
    " RMSNorm its live blocks alone exceed the 79.15 GiB the card reports (with the fused norm"
    " torchtitan's presets then named, it fits: the test below)",
)
def test_a_published_run_that_ran_fits() -> None:
    row = _compared("titan-llama2-13b-noac")
    assert row["fits"], row


def test_the_13b_run_fits_with_the_norm_torchtitan_named_then() -> None:
    """The same run with torchtitan's fused RMSNorm, the norm its presets named when the
    numbers were taken (inferred: docs/estimate-validation.md), which keeps 4h bytes less per
    norm and token than the transformers Llama's."""
    row = _compared("titan-llama2-13b-noac-fused")
    assert not row["known"]  # the norm is inferred, not published
    assert row["fits"], row
    assert row["headroom_gib"] > 5, row


def test_fsdp_7b_bf16_mixed_fits_and_its_step_time_is_in_the_band() -> None:
    """fms-fsdp's Llama 2 7B: micro-batch 2 x 4096, sharded over 8 A100 80GB, bf16: it ran
    (3760 tokens per GPU per second); not one of the runs that set the band."""
    run = RUNS["fms-llama2-7b"]
    assert run.role == "validate"
    row = _compared(run.name)
    assert row["fits"], row
    assert row["in_band"], row


def test_runs_that_calibrate_are_not_the_ones_that_validate() -> None:
    roles = {run.role for run in validation.RUNS}
    assert roles == {"calibrate", "validate"}
    timed = [run for run in validation.RUNS if run.tps is not None]
    calibrate = [run for run in timed if run.role == "calibrate"]
    assert len(calibrate) < len(timed) - len(calibrate)
    assert len(validation.RUNS) >= 10
