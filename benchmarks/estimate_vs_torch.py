"""The estimate beside torch's own tools, measured on the same model and batch.

    python benchmarks/estimate_vs_torch.py               # both shapes, as tables
    python benchmarks/estimate_vs_torch.py small         # one shape (small or 7b)
    python benchmarks/estimate_vs_torch.py case 7b flops # one tool, one shape (one JSON line)

The model is a ``transformers.LlamaForCausalLM`` built from a config (nothing downloaded) inside
a LightningModule whose ``training_step`` returns the loss and whose optimizer is AdamW:

- ``small``: 4 layers, hidden 256, GQA (8 heads, 4 key-value heads), vocabulary 8,192,
  micro-batch 4 x 256 tokens, on real tensors;
- ``7b``: the Llama 7B shape of ``benchmarks/estimate.py``, micro-batch 1 x 2048, on fake
  tensors (``FakeTensorMode``: no memory allocated).

Each tool runs in its own process, as its docstring in torch 2.13 shows it:

- ``MemTracker`` (``torch.distributed._tools.mem_tracker``): ``track_external(module,
  optimizer, *batch.values())``, then one update inside the context. The update before it
  runs outside, so the tracked one holds the optimizer state as every later update does,
  and the tracked update runs in Lightning's order (``training_step``, ``zero_grad``,
  ``backward``, ``step``). For the small shape, also an attempt with the model on fake CUDA
  tensors.
- ``RuntimeEstimator`` (``torch.distributed._tools.runtime_estimator``) in its
  ``"operator-level-cost-model"`` (roofline) mode under ``FakeTensorMode``, over the same
  update. It asserts ``torch.cuda.is_available()`` and reads the GPU's peak FLOP/s and
  bandwidth from the device it runs on, so on a machine without a GPU it runs twice, each in a
  process of its own: once as documented (without CUDA the process is killed at the first
  operator; how it ended is reported), and once given by hand what it would read on an
  "NVIDIA H100" (its own datasheet table, ``torch._inductor.analysis.device_info``; that
  entry's bandwidth in place of the one it asks Triton for), in ``32-true`` and under CPU
  autocast to bfloat16. That second run is outside its intended use and is labelled so; its
  time per operator is also summed by operator (the estimator itself is unchanged).
- ``FlopCounterMode`` (``torch.utils.flop_counter``) around ``training_step`` and
  ``backward``; again with its ``custom_mapping`` giving the CPU's fused attention kernels
  torch's formulas for the CUDA ones; then around the optimizer step alone.
- ours: ``trace_configuration(..., device="cpu")`` (the six phases on CPU storages, comparable
  with MemTracker and FlopCounterMode; for the small shape also the pilot's CPU tensor tracker
  on real tensors, ``measure_cpu``, and the module built by a factory), ``estimate(...)`` for
  an H100 SXM 80GB in ``32-true`` and ``bf16-mixed`` (one configuration each), a what-if grid
  (3 targets x micro-batches 1, 2, 4, 8 x checkpointing off, full, selective x one GPU or
  FSDP over 8, ``bf16-mixed``), and the largest micro-batch and sequence length (``bf16-true``,
  full checkpointing, as ``benchmarks/estimate.py case 7b-largest``).

Numbers are compared in ``32-true``, so the precision policy (CPU autocast's lists against
CUDA's) does not enter. Wall times exclude imports; "setup" is building the module and the
update before the tracked one (the estimate derives a later update from the first). The
report is markdown on stdout; each case's JSON goes to stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.simplefilter("ignore")

import torch  # noqa: E402

torch.set_num_threads(1)

from estimate import LLAMA  # noqa: E402  (benchmarks/estimate.py, beside this script)

SHAPES: dict[str, dict[str, Any]] = {
    "small": {
        "config": {
            "vocab_size": 8192,
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "max_position_embeddings": 1024,
        },
        "micro_batch": 4,
        "seq_len": 256,
        "real": True,
    },
    "7b": {
        "config": dict(LLAMA["7b"]),  # the 7B shape of benchmarks/estimate.py
        "micro_batch": 1,
        "seq_len": 2048,
        "real": False,
    },
}
TOOLS = (
    "ours_cpu",
    "ours_gpu",
    "ours_grid",
    "memtracker",
    "flops",
    "runtime_documented",
    "runtime",
)
TARGET = "H100-SXM-80GB"


def module_class() -> Any:
    import transformers
    from lightning.pytorch import LightningModule

    class Llama(LightningModule):
        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__()
            self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))

        def training_step(self, batch: Any, batch_idx: int = 0) -> Any:
            return self.model(**batch).loss

        def validation_step(self, batch: Any, batch_idx: int = 0) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Llama


def real_batch(shape: dict[str, Any]) -> dict[str, torch.Tensor]:
    vocab = shape["config"]["vocab_size"]
    size = (shape["micro_batch"], shape["seq_len"])
    ids = torch.randint(0, vocab, size, generator=torch.Generator().manual_seed(0))
    # No attention mask: every tool sees the same causal attention (is_causal=True).
    return {"input_ids": ids, "labels": ids.clone()}


class Workload:
    """The module, its optimizer and the batch, real or fake, with the update before."""

    def __init__(self, shape: dict[str, Any]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        started = time.perf_counter()
        self.mode = None if shape["real"] else FakeTensorMode(allow_non_fake_inputs=True)
        batch = real_batch(shape)
        if self.mode is not None:
            self.mode.__enter__()
            batch = {key: self.mode.from_tensor(value) for key, value in batch.items()}
        torch.manual_seed(0)
        self.module = module_class()(shape["config"])
        self.batch = batch
        self.optimizer = self.module.configure_optimizers()
        self.build_s = time.perf_counter() - started

    def update(self, autocast: bool = False) -> None:
        """One update in Lightning's order: the step (under CPU autocast to bfloat16 when
        ``autocast``, as Lightning's ``bf16-mixed`` on a CPU), zero_grad, backward, the
        optimizer."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = self.module.training_step(self.batch, 0)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def close(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)


def op_name(packet: Any) -> str:
    return str(packet).split(".")[-1] if "." in str(packet) else str(packet)


def run_memtracker(shape: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    work = Workload(shape)
    started = time.perf_counter()
    work.update()  # the update before: the optimizer state exists when the tracked one runs
    setup = work.build_s + time.perf_counter() - started
    tracker = MemTracker()
    tracker.track_external(work.module, work.optimizer, *work.batch.values())
    started = time.perf_counter()
    with tracker:
        work.update()
    seconds = time.perf_counter() - started
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    root = tracker.memory_tracking[work.module.model]

    def phase_peak(state: Any) -> int:
        return int(max(next(iter(s.values()))["Total"] for s in root.snapshots[state] if s))

    out = {
        "tool": "memtracker",
        "setup_s": round(setup, 2),
        "seconds": round(seconds, 2),
        "peak_bytes": int(peak["Total"]),
        "peak_categories": {
            str(k.value if hasattr(k, "value") else k): int(v) for k, v in peak.items()
        },
        "forward_bytes": phase_peak(_ModState.PEAK_FW),
        "backward_bytes": phase_peak(_ModState.PEAK_BW),
        "modules": len(tracker.memory_tracking),
        "fake_cuda": fake_cuda_attempt(shape) if shape["real"] else None,
    }
    work.close()
    return out


def fake_cuda_attempt(shape: dict[str, Any]) -> str:
    """MemTracker rounds CUDA storages to 512 bytes; can it see the model on fake CUDA tensors
    where torch has no CUDA (a CPU build)?"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            module = module_class()(shape["config"]).to("cuda")
            batch = {k: mode.from_tensor(v).to("cuda") for k, v in real_batch(shape).items()}
            with MemTracker() as tracker:
                module.training_step(batch, 0).backward()
        return f"ran: peak {tracker.get_tracker_snapshot('peak')}"
    except Exception as err:  # reported, whatever it is
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"


def run_flops(shape: dict[str, Any]) -> dict[str, Any]:
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop, sdpa_flop

    work = Workload(shape)
    started = time.perf_counter()
    work.update()
    setup = work.build_s + time.perf_counter() - started
    counter = FlopCounterMode(display=False)
    started = time.perf_counter()
    with counter:
        loss = work.module.training_step(work.batch, 0)
        work.optimizer.zero_grad(set_to_none=True)
        loss.backward()
    seconds = time.perf_counter() - started
    by_op = {op_name(k): int(v) for k, v in counter.get_flop_counts()["Global"].items()}
    # The CPU's fused attention kernels are not in FlopCounterMode's registry; its documented
    # ``custom_mapping`` can give them torch's own formulas for the CUDA kernels (full T x T).
    mapped = FlopCounterMode(
        display=False,
        custom_mapping={
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop.__wrapped__,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
                sdpa_backward_flop.__wrapped__
            ),
        },
    )
    with mapped:
        loss = work.module.training_step(work.batch, 0)
        work.optimizer.zero_grad(set_to_none=True)
        loss.backward()
    step = FlopCounterMode(display=False)
    with step:
        work.optimizer.step()
    out = {
        "tool": "flops",
        "setup_s": round(setup, 2),
        "seconds": round(seconds, 2),
        "forward_backward_flops": int(counter.get_total_flops()),
        "by_op": by_op,
        "mapped_flops": int(mapped.get_total_flops()),
        "mapped_by_op": {op_name(k): int(v) for k, v in mapped.get_flop_counts()["Global"].items()},
        "optimizer_step_flops": int(step.get_total_flops()),
        "modules": len(counter.get_flop_counts()),
    }
    work.close()
    return out


def run_runtime_documented(shape: dict[str, Any]) -> dict[str, Any]:
    """RuntimeEstimator's roofline as its docstring shows it (on a machine without a GPU the
    process ends at the first operator: ``measure`` records how)."""
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    work = Workload(dict(shape, real=False))
    work.update()
    estimator = RuntimeEstimator()
    with estimator("operator-level-cost-model"):
        work.update()
    out = {"tool": "runtime_documented", "total_ms": round(estimator.total_runtime, 3)}
    work.close()
    return out


def counting_estimator() -> Any:
    """RuntimeEstimator, unchanged, with its per-operator estimates summed by operator."""
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    class CountingEstimator(RuntimeEstimator):
        def __call__(self, estimate_mode_type: str) -> Any:
            super().__call__(estimate_mode_type)
            inner = self._estimate
            self.by_op: dict[str, float] = defaultdict(float)

            def counted(func: Any, args: Any, kwargs: Any) -> Any:
                out, op_time = inner(func, args, kwargs)
                self.by_op[str(func._overloadpacket)] += op_time
                return out, op_time

            self._estimate = counted
            return self

    return CountingEstimator()


def run_runtime(shape: dict[str, Any]) -> dict[str, Any]:
    """RuntimeEstimator's roofline with the figures it would read on an H100, by hand."""
    from unittest import mock

    import torch.utils._runtime_estimation as runtime_estimation
    from torch._inductor.analysis.device_info import lookup_device_info

    fake = dict(shape, real=False)
    work = Workload(fake)
    started = time.perf_counter()
    work.update()
    setup = work.build_s + time.perf_counter() - started
    out: dict[str, Any] = {"tool": "runtime", "setup_s": round(setup, 2)}
    estimator = counting_estimator()
    # Outside its intended use: the figures it would read on an "NVIDIA H100", by hand.
    h100 = lookup_device_info("NVIDIA H100")
    assert h100 is not None
    out["stand_in"] = {"device_name": "NVIDIA H100", "dram_gbps": h100.dram_bw_gbs}
    patches = (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_name", return_value="NVIDIA H100"),
        mock.patch.object(runtime_estimation, "get_gpu_dram_gbps", return_value=h100.dram_bw_gbs),
    )
    for patch in patches:
        patch.start()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            tflops = runtime_estimation.get_device_tflops(dtype)
            out["stand_in"][f"{str(dtype).split('.')[-1]}_tflops"] = tflops
        for precision in ("32-true", "bf16-mixed"):
            started = time.perf_counter()
            with estimator("operator-level-cost-model"):
                work.update(autocast=precision == "bf16-mixed")
            runtimes = estimator.mod_runtimes.get("LlamaForCausalLM") or {}
            top = sorted(estimator.by_op.items(), key=lambda item: -item[1])[:4]
            out[precision] = {
                "top_ops_ms": {name: round(ms, 3) for name, ms in top},
                "seconds": round(time.perf_counter() - started, 2),
                "total_ms": round(estimator.total_runtime, 3),
                "model_fw_ms": round(runtimes.get("fw", 0.0), 3),
                "model_bw_ms": round(runtimes.get("bw", 0.0), 3),
            }
    finally:
        for patch in patches:
            patch.stop()
    out["modules"] = len(estimator.mod_runtimes)
    work.close()
    return out


def ours_inputs(shape: dict[str, Any]) -> dict[str, Any]:
    """Ours takes the live module (small) or a factory building it fake (7b)."""
    llama = module_class()
    if shape["real"]:
        torch.manual_seed(0)
        return {"module": llama(shape["config"]), "batch": real_batch(shape)}
    return {"factory": lambda: llama(shape["config"]), "batch": real_batch(shape)}


def run_ours_cpu(shape: dict[str, Any]) -> dict[str, Any]:
    from lightning_pilot.estimate import trace_configuration

    inputs = ours_inputs(shape)
    started = time.perf_counter()
    traces = trace_configuration(
        **inputs,
        precision="32-true",
        micro_batch=shape["micro_batch"],
        seq_len=shape["seq_len"],
        device="cpu",
    )
    seconds = time.perf_counter() - started
    by_op: dict[str, int] = defaultdict(int)
    for phase in ("forward", "backward"):
        for name, flops in zip(traces[phase].names, traces[phase].flops, strict=True):
            if flops:
                by_op[name.split(".")[0].removeprefix("aten::")] += int(flops)
    real: dict[str, Any] | None = None
    if shape["real"]:
        # A third opinion on real tensors: the pilot's CPU tensor tracker, two real updates.
        from lightning_pilot.estimate import measure_cpu

        real = measure_cpu(
            **ours_inputs(shape), micro_batch=shape["micro_batch"], seq_len=shape["seq_len"]
        )
        # The same module built by a factory (fake from the start) instead of converted live.
        llama = module_class()
        built = trace_configuration(
            factory=lambda: llama(shape["config"]),
            batch=real_batch(shape),
            micro_batch=shape["micro_batch"],
            seq_len=shape["seq_len"],
            device="cpu",
        )
        real = {**real, "factory": {name: int(t.peak_bytes) for name, t in built.items()}}
    return {
        "tool": "ours_cpu",
        "seconds": round(seconds, 2),
        "measured_real": real,
        "phases": {name: int(trace.peak_bytes) for name, trace in traces.items()},
        "categories": {name: dict(trace.categories) for name, trace in traces.items()},
        "forward_backward_flops": int(
            traces["forward"].flops.sum() + traces["backward"].flops.sum()
        ),
        "optimizer_step_flops": int(traces["optimizer_step"].flops.sum()),
        "by_op": dict(by_op),
    }


def _roofline(notes: str) -> tuple[float, float]:
    part = notes.split("roofline: ")[1]
    compute = float(part.split(" s compute-bound")[0])
    memory = float(part.split("compute-bound, ")[1].split(" s memory-bound")[0])
    return compute, memory


def run_ours_gpu(shape: dict[str, Any]) -> dict[str, Any]:
    from lightning_pilot.estimate import estimate

    inputs = ours_inputs(shape)
    started = time.perf_counter()
    result = estimate(
        **inputs,
        targets=[TARGET],
        precisions=["32-true", "bf16-mixed"],
        micro_batches=[shape["micro_batch"]],
        seq_lens=[shape["seq_len"]],
        largest=False,
        workers=1,
    )
    seconds = time.perf_counter() - started
    out: dict[str, Any] = {"tool": "ours_gpu", "seconds": round(seconds, 2), "precisions": {}}
    for precision in ("32-true", "bf16-mixed"):
        rows = [row for row in result.rows if row["precision"] == precision]
        compute, memory = _roofline(rows[0]["notes"])
        out["precisions"][precision] = {
            "status": sorted({row["status"] for row in rows}),
            "phases": {row["phase"]: int(row["peak_allocated_bytes"]) for row in rows},
            "fits": bool(all(row["fits"] for row in rows)),
            "ideal_ms": round((compute + memory) * 1000, 3),
            "band_ms": [
                round(rows[0]["step_time_low_s"] * 1000, 3),
                round(rows[0]["step_time_high_s"] * 1000, 3),
            ],
            "flops_per_update": int(rows[0]["flops_per_update"]),
            **roofline_parts(shape, precision),
        }
    return out


def roofline_parts(shape: dict[str, Any], precision: str) -> dict[str, Any]:
    """The update's operators on the target, traced again (not timed): how much of the ideal
    is the 2 us floor per operator, and the ideal without it."""
    import numpy as np

    from lightning_pilot.estimate import TARGETS, trace_configuration
    from lightning_pilot.estimate.roofline import KERNEL_FLOOR_S

    traces = trace_configuration(
        **ours_inputs(shape),
        precision=precision,
        micro_batch=shape["micro_batch"],
        seq_len=shape["seq_len"],
        device="cuda",
    )
    phases = [traces[name] for name in ("forward", "backward", "optimizer_step")]
    flops = np.concatenate([trace.flops for trace in phases]).astype(float)
    moved = np.concatenate([trace.moved for trace in phases]).astype(float)
    kinds = np.concatenate([trace.kinds for trace in phases]).astype(np.int64)
    target = TARGETS[TARGET]
    peaks = np.array([np.inf, target.fp32, target.bf16, target.fp16])
    compute = flops / peaks[kinds]
    memory = moved / target.bandwidth
    work = (flops > 0) | (moved > 0)
    per_op = np.maximum(compute, memory) * work
    edges = np.cumsum([0] + [len(trace.flops) for trace in phases])
    by_phase = {
        trace.phase: round(float(per_op[edges[i] : edges[i + 1]].sum()) * 1000, 3)
        for i, trace in enumerate(phases)
    }
    return {
        "no_floor_by_phase_ms": by_phase,
        "operators": int(work.sum()),
        "under_floor": int(((per_op < KERNEL_FLOOR_S) & work).sum()),
        "ideal_no_floor_ms": round(float(per_op.sum()) * 1000, 3),
        "compute_ms": round(float(compute[work & (compute >= memory)].sum()) * 1000, 3),
        "memory_ms": round(float(memory[work & (compute < memory)].sum()) * 1000, 3),
    }


def run_ours_grid(shape: dict[str, Any]) -> dict[str, Any]:
    """A what-if grid (no searches), then the largest micro-batch and sequence length (as
    ``benchmarks/estimate.py case 7b-largest`` searches them: bf16-true, full checkpointing)."""
    from lightning_pilot.estimate import estimate

    started = time.perf_counter()
    result = estimate(
        **ours_inputs(shape),
        targets=[TARGET, "A100-40GB", "L4-24GB"],
        precisions=["bf16-mixed"],
        micro_batches=[1, 2, 4, 8],
        seq_lens=[shape["seq_len"]],
        checkpointing=[False, True, "selective"],
        strategies=["single", "fsdp:8"],
        largest=False,
        workers=1,
    )
    seconds = time.perf_counter() - started
    started = time.perf_counter()
    search = estimate(
        **ours_inputs(shape),
        targets=[TARGET],
        precisions=["bf16-true"],
        micro_batches=[2, 4],
        seq_lens=[shape["seq_len"]],
        checkpointing=[True],
        workers=1,
    )
    search_seconds = time.perf_counter() - started
    largest = search.largest[0]
    return {
        "tool": "ours_grid",
        "seconds": round(seconds, 2),
        "rows": len(result.rows),
        "configurations": len(
            {
                (r["target"], r["micro_batch"], r["checkpointing"], r["strategy"])
                for r in result.rows
            }
        ),
        "status": sorted({row["status"] for row in result.rows}),
        "fits": sum(bool(row["fits"]) for row in result.rows if row["phase"] == "forward"),
        "search_seconds": round(search_seconds, 2),
        "largest_micro_batch": largest["largest_micro_batch"],
        "largest_seq_len": largest["largest_seq_len"],
        "seq_len_micro_batch": largest["seq_len_micro_batch"],
        "largest_checked": [largest["checked"], largest["seq_len_checked"]],
    }


RUNNERS = {
    "ours_cpu": run_ours_cpu,
    "ours_gpu": run_ours_gpu,
    "ours_grid": run_ours_grid,
    "memtracker": run_memtracker,
    "flops": run_flops,
    "runtime_documented": run_runtime_documented,
    "runtime": run_runtime,
}


def run_case(shape_name: str, tool: str) -> dict[str, Any]:
    started = time.perf_counter()
    import lightning.pytorch  # noqa: F401
    import transformers  # noqa: F401

    import lightning_pilot.estimate  # noqa: F401

    imports = time.perf_counter() - started
    out = RUNNERS[tool](SHAPES[shape_name])
    out["shape"] = shape_name
    out["import_s"] = round(imports, 2)
    out["load"] = round(os.getloadavg()[0], 1)
    return out


def measure(shape_name: str) -> dict[str, dict[str, Any]]:
    results = {}
    for tool in TOOLS:
        done = subprocess.run(
            [sys.executable, __file__, "case", shape_name, tool],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if lines:
            results[tool] = json.loads(lines[-1])
        else:
            last = [line.strip() for line in done.stderr.splitlines() if line.strip()][-3:]
            results[tool] = {"error": " ".join(last), "rc": done.returncode}
        print(json.dumps(results[tool]), file=sys.stderr, flush=True)
    return results


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def gflop(value: float) -> str:
    return f"{value / 1e9:,.2f}"


def diff(ours: float, theirs: float) -> str:
    if not theirs:
        return "n/a"
    if ours == theirs:
        return "0 (equal)"
    return f"{ours - theirs:+,.0f} ({(ours / theirs - 1) * 100:+.5f} %)"


def how_it_ended(out: dict[str, Any]) -> str:
    if "error" not in out:
        return f"ran: {out['total_ms']} ms"
    rc = out["rc"]
    if rc < 0:
        import signal

        return f"process killed by {signal.Signals(-rc).name}: {out['error']}"
    return f"exit {rc}: {out['error']}"


def report(shape_name: str, r: dict[str, dict[str, Any]]) -> None:
    shape = SHAPES[shape_name]
    config = shape["config"]
    kind = "real tensors" if shape["real"] else "fake tensors"
    print(
        f"\n## {shape_name}: Llama, {config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, micro-batch {shape['micro_batch']} x {shape['seq_len']}, "
        f"AdamW; torch's memory and FLOP tools on {kind}\n"
    )
    documented = r.pop("runtime_documented")
    bad = [tool for tool, out in r.items() if "error" in out]
    for tool in bad:
        print(f"{tool} failed: {r[tool]['error']}")
    if bad:
        return
    ours, mt, fc, rt = r["ours_cpu"], r["memtracker"], r["flops"], r["runtime"]
    gpu = r["ours_gpu"]["precisions"]
    real = ours["measured_real"]
    phases = ours["phases"]
    train = max(phases[p] for p in ("forward", "backward", "optimizer_step"))
    print("Same question, 32-true, CPU storages (bytes; FLOPs):\n")
    print("| question | ours | torch | ours - torch |")
    print("|---|---:|---:|---:|")
    print(
        f"| peak of a later training update | {train:,} | MemTracker {mt['peak_bytes']:,} | "
        f"{diff(train, mt['peak_bytes'])} |"
    )
    for phase in ("forward", "backward"):
        a, b = phases[phase], mt[f"{phase}_bytes"]
        print(f"| peak during {phase} | {a:,} | MemTracker {b:,} | {diff(a, b)} |")
    if real:
        print(
            f"| (the pilot's CPU tensor tracker, real tensors: forward {real['forward']:,}, "
            f"backward {real['backward']:,}; ours with the module built by a factory: forward "
            f"{real['factory']['forward']:,}, backward {real['factory']['backward']:,}) | | | |"
        )
    a, b = ours["forward_backward_flops"], fc["forward_backward_flops"]
    print(f"| FLOPs, forward + backward | {a:,} | FlopCounterMode {b:,} | {diff(a, b)} |")
    a, b = ours["by_op"].get("mm", 0), fc["by_op"].get("mm", 0)
    print(f"| ... matrix products (`mm`) | {a:,} | {b:,} | {diff(a, b)} |")
    attention = [op for op in fc["mapped_by_op"] if "attention" in op]
    a = sum(ours["by_op"].get(op, 0) for op in attention)
    b = sum(fc["by_op"].get(op, 0) for op in attention)
    m = sum(fc["mapped_by_op"][op] for op in attention)
    print(f"| ... attention (CPU fused kernels) | {a:,} | {b:,} | |")
    print(
        f"| ... attention, FlopCounterMode given torch's formulas for them (`custom_mapping`) | "
        f"{a:,} (causal: kept pairs) | {m:,} (full T x T) | ratio {a / m:.4f} |"
    )
    print(
        f"| FLOPs, optimizer step | {ours['optimizer_step_flops']:,} | FlopCounterMode "
        f"{fc['optimizer_step_flops']:,} | |"
    )
    print("\nUpdate time on an H100 SXM at 100 % of the roofline (ms):\n")
    print(
        "| precision | ours: ideal (floor 2 us per operator) | ours without the floor | "
        "RuntimeEstimator, H100 figures by hand | of which `prim.device` | its `mm` |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for precision in ("32-true", "bf16-mixed"):
        row, theirs = gpu[precision], rt[precision]
        print(
            f"| {precision} | {row['ideal_ms']} | {row['ideal_no_floor_ms']} "
            f"({row['under_floor']} of {row['operators']} operators under the floor) | "
            f"{theirs['total_ms']} | {theirs['top_ops_ms'].get('prim.device', 0)} | "
            f"{theirs['top_ops_ms'].get('aten.mm', 0)} |"
        )
    print(
        f"\n(RuntimeEstimator read {rt['stand_in']['float32_tflops']} TFLOP/s fp32, "
        f"{rt['stand_in']['bfloat16_tflops']} bf16, {rt['stand_in']['dram_gbps']} GB/s; ours "
        f"per phase without the floor, 32-true: {gpu['32-true']['no_floor_by_phase_ms']}; "
        f"bf16-mixed: {gpu['bf16-mixed']['no_floor_by_phase_ms']})"
    )
    print(
        "\nWhat each took (seconds, imports excluded; setup: building the module and the "
        "update before the tracked one):\n"
    )
    print("| tool | answers | wall s | setup s | figures |")
    print("|---|---|---:|---:|---|")
    print(
        f'| ours, `trace_configuration(device="cpu")`, 32-true | peak and categories per '
        f"phase (six phases), FLOPs and bytes per operator | {ours['seconds']} | 0 | "
        + ", ".join(f"{k} {mib(v)}" for k, v in phases.items())
        + " MiB |"
    )
    h100 = []
    for precision, row in gpu.items():
        h100.append(
            f"{precision}: peak {mib(max(row['phases'].values()))} MiB per GPU, fits "
            f"{row['fits']}, band {row['band_ms'][0]} to {row['band_ms'][1]} ms"
        )
    print(
        f"| ours, `estimate()` on {TARGET}, 32-true and bf16-mixed | per-GPU peak per phase, "
        f"fits, step-time band | {r['ours_gpu']['seconds']} | 0 | {'; '.join(h100)} |"
    )
    g = r["ours_grid"]
    print(
        f"| ours, `estimate()` what-if grid: 3 targets x micro-batch 1, 2, 4, 8 x "
        f"checkpointing off, full, selective x 1 GPU or FSDP over 8, bf16-mixed | the above "
        f"per configuration | {g['seconds']} | 0 | {g['rows']} rows, {g['configurations']} "
        f"configurations ({g['fits']} fit), status {g['status']} |"
    )
    print(
        f"| ours, `estimate()` largest micro-batch and sequence length, {TARGET}, bf16-true, "
        f"full checkpointing | the search, confirmed by tracing | {g['search_seconds']} | 0 | "
        f"micro-batch {g['largest_micro_batch']} at {shape['seq_len']}, sequence "
        f"{g['largest_seq_len']} at micro-batch {g['seq_len_micro_batch']}, checked "
        f"{g['largest_checked']} |"
    )
    print(
        f"| MemTracker | peak and categories, snapshots per module | {mt['seconds']} | "
        f"{mt['setup_s']} | peak {mib(mt['peak_bytes'])} MiB, {mt['modules']} modules |"
    )
    print(
        f"| FlopCounterMode | FLOPs per module and operator | {fc['seconds']} | "
        f"{fc['setup_s']} | {gflop(fc['forward_backward_flops'])} GFLOP, {fc['modules']} "
        f"modules |"
    )
    print(
        f"| RuntimeEstimator, as documented, no GPU | step time on the local GPU | | | "
        f"{how_it_ended(documented)} |"
    )
    times = "; ".join(
        f"{p}: {rt[p]['total_ms']} ms in {rt[p]['seconds']} s (model fw {rt[p]['model_fw_ms']}, "
        f"bw {rt[p]['model_bw_ms']})"
        for p in ("32-true", "bf16-mixed")
    )
    print(
        f"| RuntimeEstimator, H100 figures by hand | step time, per module forward and "
        f"backward | | {rt['setup_s']} | {times}; {rt['modules']} modules |"
    )
    if mt.get("fake_cuda"):
        print(
            f"\nMemTracker with the model on fake CUDA tensors (this torch build has no CUDA): "
            f"{mt['fake_cuda']}"
        )
    loads = [float(out["load"]) for out in r.values() if out.get("load")]
    if loads:
        print(
            f"\nLoad average (1 min) during the cases: {min(loads)} to {max(loads)} on "
            f"{os.cpu_count()} cores."
        )


def main(argv: list[str]) -> None:
    if argv[:1] == ["case"]:
        print(json.dumps(run_case(argv[1], argv[2])), flush=True)
        return
    for name in argv or list(SHAPES):
        report(name, measure(name))


if __name__ == "__main__":
    main(sys.argv[1:])
