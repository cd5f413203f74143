"""The estimate's accuracy table and speed goals (``docs/estimate.md`` has the figures).

    python benchmarks/estimate.py              # everything, as a table
    python benchmarks/estimate.py accuracy     # fake-tensor estimate vs real CPU tensors
    python benchmarks/estimate.py speed        # 7B / 70B Llama shapes, each in its own process
    python benchmarks/estimate.py case 70b-grid   # one speed case (prints one JSON line)
    python benchmarks/estimate.py case 7b-blocks-check   # blocks cut vs traced in full (also 70b-)

Accuracy: per phase, the estimate's peak allocated bytes on fake tensors against the CPU
tensor tracker on real tensors (``measure_cpu``), for the models of ``tests/estimate``.
Speed: Llama shapes from ``transformers.LlamaConfig`` built under the fake mode (nothing
downloaded, nothing allocated), on this machine's cores; peak resident memory is the child
process's ``ru_maxrss``. The tracking overhead is one traced forward + backward against the
same step on fake tensors with no tracking (the bare step).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "estimate"))
warnings.simplefilter("ignore")

import torch  # noqa: E402

torch.set_num_threads(1)

LLAMA = {
    "7b": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
    },
    "70b": {
        "vocab_size": 32000,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
    },
}


def llama_factory(size: str) -> Any:
    import transformers
    from lightning.pytorch import LightningModule

    config = transformers.LlamaConfig(**LLAMA[size])

    class Llama(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.LlamaForCausalLM(config)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Llama


def token_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run_case(name: str) -> dict[str, Any]:
    """One speed case, in this process."""
    started = time.perf_counter()
    import lightning.pytorch  # noqa: F401
    import transformers  # noqa: F401

    from lightning_pilot.estimate import estimate

    out: dict[str, Any] = {"case": name, "import_s": round(time.perf_counter() - started, 2)}
    started = time.perf_counter()
    if name == "7b-one":
        result = estimate(
            factory=llama_factory("7b"),
            batch=token_batch(),
            micro_batches=[4],
            seq_lens=[2048],
            largest=False,
        )
        out["rows"] = len(result.rows)
        out["status"] = sorted({row["status"] for row in result.rows})
        forward = next(row for row in result.rows if row["phase"] == "forward")
        out["forward_peak_gib"] = round(forward["peak_allocated_bytes"] / 2**30, 2)
        out["step_time_s"] = [
            round(forward["step_time_low_s"], 3),
            round(forward["step_time_high_s"], 3),
        ]
    elif name == "70b-grid":
        result = estimate(
            factory=llama_factory("70b"),
            batch=token_batch(),
            precisions=["bf16-mixed", "bf16-true"],
            micro_batches=[1, 2, 4, 8],
            seq_lens=[4096],
            checkpointing=[False, True],
            largest=False,
        )
        out["configurations"] = len(result.rows) // 6
        out["rows"] = len(result.rows)
        out["status"] = sorted({row["status"] for row in result.rows})
        out["methods"] = sorted({row["method"] for row in result.rows})
        notes = [row["notes"] or "" for row in result.rows]
        out["rows_blocks_extrapolated"] = sum("blocks: traced with" in n for n in notes)
        out["rows_traced_in_full"] = sum("blocks: traced in full" in n for n in notes)
    elif name == "7b-largest":
        result = estimate(
            factory=llama_factory("7b"),
            batch=token_batch(),
            targets=["H100-SXM-80GB"],
            precisions=["bf16-true"],
            micro_batches=[2, 4],
            seq_lens=[2048],
            checkpointing=[True],
        )
        keys = ("largest_micro_batch", "checked", "method", "largest_seq_len")
        keys += ("seq_len_micro_batch", "seq_len_checked", "seq_len_method", "seq_len_reason")
        out["largest"] = [{k: row.get(k) for k in keys} for row in result.largest]
    elif name in ("7b-blocks-check", "70b-blocks-check"):
        # One configuration per checkpointing setting, with the blocks cut and extrapolated,
        # against the same traced in full: every byte, FLOP and time column of every row.
        frames = {}
        for blocks in (True, False):
            begun = time.perf_counter()
            frames[blocks] = estimate(
                factory=llama_factory(name.split("-")[0]),
                batch=token_batch(),
                precisions=["bf16-mixed"],
                micro_batches=[4] if name.startswith("7b") else [1],
                seq_lens=[2048] if name.startswith("7b") else [4096],
                checkpointing=[False, True],
                largest=False,
                blocks=blocks,
            ).frame()
            out[f"seconds_blocks_{blocks}"] = round(time.perf_counter() - begun, 2)
        numeric = [c for c in frames[True].columns if c.endswith(("_bytes", "_s", "_update"))]
        diff = (frames[True][numeric] - frames[False][numeric]).abs().to_numpy().max()
        out["rows"] = len(frames[True])
        out["largest_difference"] = float(diff)
    elif name == "overhead":
        out.update(overhead())
    out["seconds"] = round(time.perf_counter() - started, 2)
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    # Precisions are traced in forked workers: their largest resident set, each.
    out["worker_peak_rss_mib"] = round(
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    )
    return out


def overhead() -> dict[str, Any]:
    """A traced forward + backward (7B, 1 x 2048, bf16-mixed) against the bare fake step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_pilot.estimate import Session, reshape_batch

    batch = reshape_batch(token_batch(), 1, 2048)
    factory = llama_factory("7b")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        module = factory()
        fake = {key: mode.from_tensor(value) for key, value in batch.items()}
        bare = []
        for _ in range(2):
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = module.training_step(fake, 0)
            loss.backward()
            bare.append(time.perf_counter() - started)
            module.zero_grad(set_to_none=True)
            del loss
    out: dict[str, Any] = {"bare_step_s": round(min(bare), 2)}
    # Traced in full (the tracking's own cost), and with the 32 blocks cut to 3, 4 and 5.
    for blocks, label in ((False, "traced_step_s"), (True, "blocks_step_s")):
        traced = []
        with Session(
            factory=factory, precision="bf16-mixed", round_to=512, blocks=blocks
        ) as session:
            for _ in range(2):
                started = time.perf_counter()
                session.train_phases(batch, micro_batch=1, seq_len=2048)
                traced.append(time.perf_counter() - started)
        out[label] = round(min(traced), 2)
    out["overhead"] = round(out["traced_step_s"] / out["bare_step_s"], 2)
    return out


def speed() -> list[dict[str, Any]]:
    results = []
    for name in ("7b-one", "70b-grid", "7b-largest", "7b-blocks-check", "overhead"):
        done = subprocess.run(
            [sys.executable, __file__, "case", name],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"case": name, "error": done.stderr[-2000:]}
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def accuracy() -> list[dict[str, Any]]:
    from test_accuracy import CASES

    from lightning_pilot.estimate import PHASE_ORDER, measure_cpu
    from lightning_pilot.estimate.grid import trace_configuration

    rows = []
    for name, (make, batch_of, micro_batch, seq_len) in sorted(CASES.items()):
        for precision in ("32-true", "bf16-mixed"):
            batch = batch_of()
            torch.manual_seed(0)
            real = measure_cpu(
                make(), batch, micro_batch=micro_batch, seq_len=seq_len, precision=precision
            )
            torch.manual_seed(0)
            started = time.perf_counter()
            traced = trace_configuration(
                make(), batch, micro_batch=micro_batch, seq_len=seq_len, precision=precision
            )
            seconds = time.perf_counter() - started
            errors = {phase: traced[phase].peak_bytes / real[phase] - 1 for phase in PHASE_ORDER}
            worst = max(errors, key=lambda phase: abs(errors[phase]))
            row = {
                "model": name,
                "precision": precision,
                "forward_real": real["forward"],
                "forward_estimate": traced["forward"].peak_bytes,
                "worst_phase": worst,
                "worst_error": round(errors[worst], 5),
                "estimate_s": round(seconds, 2),
            }
            print(
                f"{name:22s} {precision:10s} forward real {real['forward']:>10,d} estimate"
                f" {traced['forward'].peak_bytes:>10,d}  worst {worst:20s}"
                f" {errors[worst]:+.3%}  ({seconds:.2f} s)",
                flush=True,
            )
            rows.append(row)
    return rows


def main(argv: list[str]) -> None:
    if argv[:1] == ["case"]:
        print(json.dumps(run_case(argv[1])))
        return
    if not argv or argv[0] == "accuracy":
        accuracy()
    if not argv or argv[0] == "speed":
        speed()


if __name__ == "__main__":
    main(sys.argv[1:])
