"""The estimate made on a CPU against a real GPU: GPT-2 124M shape (dropout 0.1 on), micro-batch
8 x 1024, AdamW, in bf16-mixed and in 16-mixed (with a GradScaler), activation checkpointing off
and on.

    python benchmarks/estimate_gpu.py            # estimate (CPU), then measure (if CUDA)
    python benchmarks/estimate_gpu.py --estimate-only

The estimate half runs anywhere (fake tensors, no GPU). The measurement half runs where CUDA
is available: the same phases as the estimate (two updates as Lightning's automatic
optimization runs them, the second measured; validation in eval mode under ``no_grad`` with
its own batch; a checkpoint save to memory), each phase's ``torch.cuda.max_memory_allocated``
and ``max_memory_reserved`` after ``reset_peak_memory_stats`` (the reserved figure holds what
the allocator caches, the previous update's gradients in the backward pass included), and the
mean time of 10 updates after 3 warm-up updates. The table gives per phase the estimate, the
measurement and their ratio, allocated and reserved, and whether the measured update time
falls inside the estimated band. Prints one JSON line at the end.
"""

from __future__ import annotations

import io
import json
import sys
import time
import warnings
from typing import Any

import torch

from lightning_pilot.vocabulary import ESTIMATE_PHASES, phase_label

warnings.simplefilter("ignore")

MICRO_BATCH = 8
SEQ_LEN = 1024
# The estimate's phases by their labels (the first optimizer step: optimizer_step_first).
PHASES = tuple(phase_label(phase, first) for phase, first in ESTIMATE_PHASES)


def module_class() -> Any:
    import transformers
    from lightning.pytorch import LightningModule

    class GPT2(LightningModule):
        """GPT-2 124M (the default GPT2Config), AdamW."""

        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config())

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    return GPT2


def batch(device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (MICRO_BATCH, SEQ_LEN), generator=generator).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def gpu_target() -> Any:
    from lightning_pilot.estimate import TARGETS

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().upper().replace(" ", "-")
        for key, target in TARGETS.items():
            if key.split("-")[0] in name and key.split("-")[1] in name:
                return target
        for key, target in TARGETS.items():
            if key.split("-")[0] in name:
                return target
    return TARGETS["H100-SXM-80GB"]


def estimate_half(checkpointing: bool, precision: str) -> dict[str, Any]:
    from lightning_pilot.estimate import estimate

    target = gpu_target()
    started = time.perf_counter()
    result = estimate(
        factory=module_class(),
        batch=batch(),
        targets=[target],
        precisions=[precision],
        micro_batches=[MICRO_BATCH],
        seq_lens=[SEQ_LEN],
        checkpointing=[checkpointing],
        largest=False,
        workers=1,
    )
    rows = {phase_label(row["phase"], row["first"]): row for row in result.rows}
    first = rows["forward"]
    return {
        "target": target.name,
        "seconds": round(time.perf_counter() - started, 2),
        "peak": {phase: rows[phase]["peak_allocated_bytes"] for phase in PHASES},
        "reserved": {phase: rows[phase]["peak_reserved_bytes"] for phase in PHASES},
        "band_s": (first["step_time_low_s"], first["step_time_high_s"]),
    }


def measure_half(checkpointing: bool, precision: str) -> dict[str, Any]:
    device = "cuda"
    dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "16-mixed")
    torch.manual_seed(0)
    module = module_class()().to(device)
    if checkpointing:
        module.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    module.train()
    optimizer = module.configure_optimizers()
    data = batch(device)
    peaks: dict[str, int] = {}
    reserved: dict[str, int] = {}

    def measured(name: str, fn: Any) -> Any:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
        reserved[name] = torch.cuda.max_memory_reserved()
        return out

    def forward() -> Any:
        with torch.autocast("cuda", dtype=dtype):
            return module.training_step(data, 0)

    def step() -> None:
        scaler.step(optimizer)
        scaler.update()

    for update in (1, 2):
        loss = measured("forward", forward)
        optimizer.zero_grad(set_to_none=True)
        measured("backward", scaler.scale(loss).backward)
        del loss
        measured(phase_label("optimizer_step", update == 1), step)
    val_data = {key: value.clone() for key, value in data.items()}
    module.eval()

    def validate(val_data: dict[str, torch.Tensor] = val_data) -> None:
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            module.validation_step(val_data, 0)

    del data, val_data
    measured("validation", validate)
    del validate
    module.train()

    def save() -> None:
        torch.save(
            {"state_dict": module.state_dict(), "optimizer": optimizer.state_dict()}, io.BytesIO()
        )

    measured("checkpoint_save", save)
    data = batch(device)
    for _ in range(3):
        loss = forward()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        loss = forward()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        step()
    torch.cuda.synchronize()
    return {
        "device": torch.cuda.get_device_name(),
        "peak": peaks,
        "reserved": reserved,
        "update_s": (time.perf_counter() - started) / 10,
    }


def main(argv: list[str]) -> None:
    measure = torch.cuda.is_available() and "--estimate-only" not in argv
    if not measure:
        print("no CUDA device (or --estimate-only): the estimate half only", flush=True)
    report: dict[str, Any] = {}
    for precision in ("bf16-mixed", "16-mixed"):
        for checkpointing in (False, True):
            est = estimate_half(checkpointing, precision)
            real = measure_half(checkpointing, precision) if measure else None
            key = f"{precision}/{'checkpointing' if checkpointing else 'plain'}"
            report[key] = {"estimate": est, "measured": real}
            print(f"\n{key}: target {est['target']}, estimate took {est['seconds']} s")
            header = f"{'phase':22s} {'quantity':9s} {'estimate MiB':>13s} {'measured MiB':>13s}"
            print(f"{header} ratio")
            for phase in PHASES:
                for quantity in ("peak", "reserved"):
                    e = est[quantity][phase]
                    line = f"{phase:22s} {quantity:9s} {e / 2**20:13.1f}"
                    if real is not None:
                        m = real[quantity][phase]
                        line += f" {m / 2**20:13.1f} {e / m:7.3f}"
                    print(line)
            low, high = est["band_s"]
            line = f"update time band {low * 1e3:.1f} to {high * 1e3:.1f} ms"
            if real is not None:
                inside = low <= real["update_s"] <= high
                where = "inside" if inside else "outside"
                line += f"; measured {real['update_s'] * 1e3:.1f} ms ({where})"
            print(line, flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
