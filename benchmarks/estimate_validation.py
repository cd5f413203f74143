"""The estimate against published, measured GPU training runs (``docs/estimate-validation.md``).

    python benchmarks/estimate_validation.py            # every run: the table and the ratios
    python benchmarks/estimate_validation.py NAME ...   # some runs (names: --list)
    python benchmarks/estimate_validation.py --list

Each run's model is built from a ``transformers`` config of the published architecture under
the fake mode (nothing downloaded, nothing allocated) and estimated with :func:`estimate` at the
run's precision, micro-batch, sequence length, activation checkpointing and strategy, on its
GPU (its memory as the device reports it, ``lightning_pilot.estimate.targets``). Memory is
compared with what the source measured, in the source's own unit and quantity
(``torch.cuda.max_memory_allocated`` in GB of 10^9 bytes for LitGPT; the allocator's peak
reserved bytes in GiB for torchtitan); step time with the source's tokens per second per GPU
(step seconds = tokens per GPU per step / tokens per second per GPU). Every figure below is
copied from the source named beside it.

The step-time band (``roofline.DEFAULT_EFFICIENCY`` and ``DEFAULT_MEMORY_EFFICIENCY``) was
calibrated on the runs whose ``role`` is ``calibrate`` (``ratio`` = measured step / ideal step
at 100 % of the roofline); the runs whose role is ``validate`` were not used to set it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.simplefilter("ignore")

import torch  # noqa: E402

torch.set_num_threads(1)

GB = 10**9
GIB = 2**30

LITGPT_2023 = (
    "https://github.com/Lightning-AI/litgpt/blob/main/tutorials/resource-tables.md"
    " (commit 4839345), 'Finetuning with LoRA on 1 GPU': LitGPT commit 8641822, PyTorch 2.1.0,"
    " 1x A100-SXM4-40GB, bf16-true, Alpaca with the longest example first"
)
LITGPT_HUB = (
    "https://github.com/Lightning-AI/litgpt/blob/main/config_hub/finetune/README.md"
    " (commit 03ffc55), 'Config files': bf16-true, Alpaca2k, max_seq_length 512"
)
TITAN_A100 = (
    "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md (commit 0413364):"
    " FSDP2 on 64 A100 80GB, bf16 parameters, WPS = tokens per second per GPU"
)
#: Why the 13B run without checkpointing is estimated with torchtitan's fused RMSNorm too: the
#: page does not name the norm, and the evidence points to the fused one.
FUSED_NORM = (
    "norm inferred, not published: the numbers were added on 2024-04-16"
    " (https://github.com/pytorch/torchtitan/pull/237); FusedRMSNorm was added on 2024-03-30"
    " ('+15% eager' MFU, https://github.com/pytorch/torchtitan/pull/181) after 'efficient"
    " normalization' was listed as a blocker for good numbers"
    " (https://github.com/pytorch/torchtitan/issues/186); on 2024-05-02 the llama3_8b preset's"
    ' norm_type changed from "fused_rmsnorm" to "rmsnorm" (https://github.com/pytorch/torchtitan/pull/297:'
    " 'I changed rmsnorm to default')"
)
TITAN_H100 = (
    "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md (commit eaea6f6),"
    " Table 1: Llama 3.1 8B, FSDP over 8 H100 (96 GB HBM2e, 500 W), local batch 2,"
    " selective activation checkpointing"
)
TITAN_H100_128 = (
    "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md (commit eaea6f6),"
    " Table 3: Llama 3.1 8B, FSDP over 128 H100 (96 GB HBM2e, 500 W; 16 hosts of 8, 400 Gb/s"
    " per GPU between hosts), local batch 2, selective activation checkpointing"
)
FMS = (
    "https://github.com/foundation-model-stack/fms-fsdp/blob/main/README.md (commit 0d31998):"
    " 128 A100 80GB, training throughput in tokens per GPU per second"
)

#: Architectures of the published models, as ``transformers`` configs (class name, fields).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-2-7b": (
        "LlamaConfig",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
        ),
    ),
    "llama-2-13b": (
        "LlamaConfig",
        dict(
            vocab_size=32000,
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=40,
            max_position_embeddings=4096,
        ),
    ),
    "llama-2-70b": (
        "LlamaConfig",
        dict(
            vocab_size=32000,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=4096,
        ),
    ),
    "codellama-34b": (
        "LlamaConfig",
        dict(
            vocab_size=32000,
            hidden_size=8192,
            intermediate_size=22016,
            num_hidden_layers=48,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=16384,
        ),
    ),
    "llama-3-8b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
        ),
    ),
    "llama-3-70b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            max_position_embeddings=8192,
        ),
    ),
    "tinyllama-1.1b": (
        "LlamaConfig",
        dict(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=2048,
        ),
    ),
    "phi-1.5": (
        "PhiConfig",
        dict(
            vocab_size=51200,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=24,
            num_attention_heads=32,
            partial_rotary_factor=0.5,
            max_position_embeddings=2048,
            # LitGPT's phi runs F.gelu(approximate="tanh"), one operator.
            hidden_act="gelu_pytorch_tanh",
        ),
    ),
    "stablelm-alpha-3b": (
        "GPTNeoXConfig",
        dict(
            vocab_size=50688,
            hidden_size=4096,
            intermediate_size=16384,
            num_hidden_layers=16,
            num_attention_heads=32,
            rotary_pct=0.25,
            max_position_embeddings=4096,
        ),
    ),
}

#: LoRA as LitGPT's ``finetune/lora.py`` of 2023 applied it: rank 8, alpha 16, dropout 0.05,
#: on the attention's query and value projections (the table's trainable parameter counts).
LORA: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.05}
_LORA_TARGETS = ("q_proj", "v_proj", "query_key_value")


@dataclass
class Run:
    """One published, measured training run and how to estimate it."""

    name: str
    model: str
    source: str
    where: str  # the table / figure / row in the source
    target: str
    precision: str
    micro_batch: int
    seq_len: int
    checkpointing: Any = False
    strategy: str = "single"
    lora: bool = False
    #: measured peak memory in ``unit`` (None: not published); ``"OOM"``: ran out of memory.
    memory: float | str | None = None
    unit: str = "GB"  # "GB" (10^9 bytes) or "GiB"
    quantity: str = "allocated"  # "allocated" (max_memory_allocated) or "reserved"
    #: measured tokens per second per GPU (None: not published).
    tps: float | None = None
    role: str = "validate"  # "calibrate", "validate", or "memory" (no step time)
    known: bool = True  # is every setting that sets the memory published?
    caveats: list[str] = field(default_factory=list)
    #: The model's RMSNorm: ``"rmsnorm"`` (the ``transformers`` Llama's, which keeps a float32
    #: copy of its input and two bfloat16 tensors) or ``"fused_rmsnorm"`` (torchtitan's Triton
    #: ``FusedRMSNorm``: it keeps its input and the reciprocal standard deviation only).
    norm: str = "rmsnorm"


_H100_96 = dict(
    name="H100-SXM-96GB-HBM2e",
    memory=96 * GIB,
    fp32=67e12,
    tf32=494.5e12,
    bf16=989.5e12,
    fp16=989.5e12,
    bandwidth=2.4e12,
    link=450e9,
    workspace_bytes=32 * 2**20,
    source="torchtitan docs/performance.md: H100 with 96 GB HBM2e at 2.4 TB/s; peak FLOP/s of"
    " the SXM datasheet (the source: 'between SXM and NVL')",
    # The runs compare reserved memory, not out-of-memory, so the capacity sets no verdict.
    memory_source="nominal 96 GiB: no device report of this H100 (96 GB HBM2e) was found; the"
    " device reports less than nominal (lightning_pilot.estimate.targets)",
)

RUNS: list[Run] = [
    # LitGPT 2023 resource tables: LoRA, bf16-true, 1x A100 40GB, longest Alpaca example first.
    Run(
        "litgpt-llama2-7b-lora-mb1",
        "llama-2-7b",
        LITGPT_2023,
        "Llama 2 7B, micro-batch 1: 21.30 GB",
        "A100-40GB",
        "bf16-true",
        1,
        1304,
        lora=True,
        memory=21.30,
    ),
    Run(
        "litgpt-llama2-7b-lora-mb2",
        "llama-2-7b",
        LITGPT_2023,
        "Llama 2 7B, micro-batch 2: 29.07 GB",
        "A100-40GB",
        "bf16-true",
        2,
        1304,
        lora=True,
        memory=29.07,
    ),
    Run(
        "litgpt-llama2-7b-lora-mb4",
        "llama-2-7b",
        LITGPT_2023,
        "Llama 2 7B, micro-batch 4: OOM",
        "A100-40GB",
        "bf16-true",
        4,
        1304,
        lora=True,
        memory="OOM",
    ),
    Run(
        "litgpt-llama2-13b-lora-mb1",
        "llama-2-13b",
        LITGPT_2023,
        "Llama 2 13B, micro-batch 1: 38.12 GB",
        "A100-40GB",
        "bf16-true",
        1,
        1304,
        lora=True,
        memory=38.12,
    ),
    Run(
        "litgpt-llama2-13b-lora-mb2",
        "llama-2-13b",
        LITGPT_2023,
        "Llama 2 13B, micro-batch 2: OOM",
        "A100-40GB",
        "bf16-true",
        2,
        1304,
        lora=True,
        memory="OOM",
    ),
    Run(
        "litgpt-phi15-lora-mb1",
        "phi-1.5",
        LITGPT_2023,
        "phi-1.5, micro-batch 1: 4.82 GB",
        "A100-40GB",
        "bf16-true",
        1,
        1044,
        lora=True,
        memory=4.82,
    ),
    Run(
        "litgpt-phi15-lora-mb4",
        "phi-1.5",
        LITGPT_2023,
        "phi-1.5, micro-batch 4: 10.68 GB",
        "A100-40GB",
        "bf16-true",
        4,
        1044,
        lora=True,
        memory=10.68,
    ),
    Run(
        "litgpt-stablelm3b-lora-mb1",
        "stablelm-alpha-3b",
        LITGPT_2023,
        "StableLM Alpha 3B, micro-batch 1: 9.69 GB",
        "A100-40GB",
        "bf16-true",
        1,
        1034,
        lora=True,
        memory=9.69,
    ),
    Run(
        "litgpt-stablelm3b-lora-mb4",
        "stablelm-alpha-3b",
        LITGPT_2023,
        "StableLM Alpha 3B, micro-batch 4: 16.92 GB",
        "A100-40GB",
        "bf16-true",
        4,
        1034,
        lora=True,
        memory=16.92,
    ),
    Run(
        "litgpt-tinyllama-full-mb4",
        "tinyllama-1.1b",
        LITGPT_HUB,
        "tiny-llama/full.yaml, 1xA10G, micro-batch 4: 14.10 GB",
        "A10G-24GB",
        "bf16-true",
        4,
        512,
        memory=14.10,
        known=False,
        caveats=[
            "Alpaca2k batches are padded to their longest sample, at most"
            " 512 tokens: the estimate at 512 is an upper bound"
        ],
    ),
    Run(
        "litgpt-llama31-8b-full-mb4",
        "llama-3-8b",
        LITGPT_HUB,
        "llama-3.1-8b/full.yaml, 1xA10G, micro-batch 4: OOM",
        "A10G-24GB",
        "bf16-true",
        4,
        512,
        memory="OOM",
    ),
    Run(
        "litgpt-llama2-7b-full-4xa10g",
        "llama-2-7b",
        LITGPT_HUB,
        "llama-2-7b/full.yaml, 4xA10G (FSDP), micro-batch 4: OOM",
        "A10G-24GB",
        "bf16-true",
        4,
        512,
        strategy="fsdp:4",
        memory="OOM",
    ),
    # torchtitan on 64 A100 80GB: step times (and one published out-of-memory).
    Run(
        "titan-llama2-13b-noac",
        "llama-2-13b",
        TITAN_A100,
        "Llama 2 table: 13B, batch 2, no AC: 2162 WPS",
        "A100-SXM-80GB",
        "bf16-mixed",
        2,
        4096,
        strategy="fsdp:64",
        tps=2162,
        role="calibrate",
    ),
    # The same run with the norm torchtitan's presets named until 2024-05-02 (see FUSED_NORM).
    Run(
        "titan-llama2-13b-noac-fused",
        "llama-2-13b",
        TITAN_A100,
        "Llama 2 table: 13B, batch 2, no AC: it ran (2162 WPS)",
        "A100-SXM-80GB",
        "bf16-mixed",
        2,
        4096,
        strategy="fsdp:64",
        known=False,
        norm="fused_rmsnorm",
        caveats=[FUSED_NORM],
    ),
    Run(
        "titan-llama2-70b-full",
        "llama-2-70b",
        TITAN_A100,
        "Llama 2 table: 70B, batch 2, full AC: 353 WPS",
        "A100-SXM-80GB",
        "bf16-mixed",
        2,
        4096,
        checkpointing=True,
        strategy="fsdp:64",
        tps=353,
        role="calibrate",
    ),
    Run(
        "titan-llama3-70b-full",
        "llama-3-70b",
        TITAN_A100,
        "Llama 3 table: 70B, batch 1, full AC: 331 WPS",
        "A100-SXM-80GB",
        "bf16-mixed",
        1,
        8192,
        checkpointing=True,
        strategy="fsdp:64",
        tps=331,
        role="calibrate",
    ),
    Run(
        "titan-llama2-70b-sac-bs2",
        "llama-2-70b",
        TITAN_A100,
        "Llama 2 table, footnote 1: 70B at local batch 2 with selective AC runs out of memory",
        "A100-SXM-80GB",
        "bf16-mixed",
        2,
        4096,
        checkpointing="selective",
        strategy="fsdp:64",
        memory="OOM",
    ),
    Run(
        "titan-llama2-70b-sac-bs1",
        "llama-2-70b",
        TITAN_A100,
        "Llama 2 table: 70B, batch 1, selective op AC: 355 WPS",
        "A100-SXM-80GB",
        "bf16-mixed",
        1,
        4096,
        checkpointing="selective",
        strategy="fsdp:64",
        tps=355,
    ),
    Run(
        "titan-llama3-8b-sac",
        "llama-3-8b",
        TITAN_A100,
        "Llama 3 table: 8B, batch 1, selective op AC: 2973 WPS",
        "A100-SXM-80GB",
        "bf16-mixed",
        1,
        8192,
        checkpointing="selective",
        strategy="fsdp:64",
        tps=2973,
    ),
    Run(
        "titan-h100-llama31-8b-sac",
        "llama-3-8b",
        TITAN_H100,
        "Table 1, FSDP: 5,762 TPS/GPU, 82.4 GiB",
        _H100_96["name"],
        "bf16-mixed",
        2,
        8192,
        checkpointing="selective",
        strategy="fsdp:8",
        memory=82.4,
        unit="GiB",
        quantity="reserved",
        tps=5762,
        caveats=[
            "the H100's peak FLOP/s are unknown ('between SXM and NVL', 500 W): the"
            " SXM datasheet's are used, so the ideal is optimistic"
        ],
    ),
    # The same configuration over 128 GPUs: memory only (its collectives cross hosts over a
    # network the target's NVLink figure does not describe).
    Run(
        "titan-h100-llama31-8b-sac-128",
        "llama-3-8b",
        TITAN_H100_128,
        "Table 3, FSDP: 67.0 GiB",
        _H100_96["name"],
        "bf16-mixed",
        2,
        8192,
        checkpointing="selective",
        strategy="fsdp:128",
        memory=67.0,
        unit="GiB",
        quantity="reserved",
    ),
    # fms-fsdp on 128 A100 80GB (HSDP shards within a node of 8): validation of the band.
    Run(
        "fms-llama2-7b",
        "llama-2-7b",
        FMS,
        "7b, HSDP, no AC, batch 2: 3760 token/gpu/sec",
        "A100-SXM-80GB",
        "bf16-mixed",
        2,
        4096,
        strategy="fsdp:8",
        tps=3760,
    ),
    Run(
        "fms-llama2-13b",
        "llama-2-13b",
        FMS,
        "13b, HSDP, no AC, batch 1: 1700 token/gpu/sec",
        "A100-SXM-80GB",
        "bf16-mixed",
        1,
        4096,
        strategy="fsdp:8",
        tps=1700,
    ),
    Run(
        "fms-codellama-34b",
        "codellama-34b",
        FMS,
        "34b, FSDP, AC, batch 8: 772 token/gpu/sec",
        "A100-SXM-80GB",
        "bf16-mixed",
        8,
        4096,
        checkpointing=True,
        strategy="fsdp:128",
        tps=772,
        caveats=["'Activation Checkpointing: True' read as every block checkpointed"],
    ),
    Run(
        "fms-llama2-70b",
        "llama-2-70b",
        FMS,
        "70b, FSDP, AC, batch 6: 380 token/gpu/sec",
        "A100-SXM-80GB",
        "bf16-mixed",
        6,
        4096,
        checkpointing=True,
        strategy="fsdp:128",
        tps=380,
        caveats=["'Activation Checkpointing: True' read as every block checkpointed"],
    ),
]


def _lora_wrap(model: torch.nn.Module) -> None:
    """Freeze ``model`` and put a rank-8 LoRA beside its query/value projections."""
    for param in model.parameters():
        param.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in _LORA_TARGETS and isinstance(child, torch.nn.Linear):
                setattr(module, name, LoRALinear(child))


class LoRALinear(torch.nn.Module):
    """``base(x) + B(A(dropout(x))) * alpha / r``, the base frozen (LitGPT's LoRA layer)."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.dropout = torch.nn.Dropout(LORA["dropout"])
        self.lora_a = torch.nn.Linear(base.in_features, LORA["r"], bias=False)
        self.lora_b = torch.nn.Linear(LORA["r"], base.out_features, bias=False)
        self.scale = LORA["alpha"] / LORA["r"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(self.dropout(x))) * self.scale


class _FusedRMSNorm(torch.autograd.Function):
    """torchtitan's Triton ``FusedRMSNorm`` as autograd sees it: one kernel each way, keeping
    its input, the weight and the reciprocal standard deviation (one float32 per row)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        scaled = grad.float() * weight.float()
        dx = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        dw = (grad.float() * normed).flatten(0, -2).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class FusedNorm(torch.nn.Module):
    """A ``transformers`` RMSNorm's weight and epsilon through :class:`_FusedRMSNorm`."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedRMSNorm.apply(x, self.weight, self.eps)


def _fuse_norms(model: torch.nn.Module) -> None:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                setattr(module, name, FusedNorm(child))


def factory(run: Run) -> Any:
    import transformers
    from lightning.pytorch import LightningModule

    kind, fields = MODELS[run.model]
    config = getattr(transformers, kind)(**fields)

    class Published(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.AutoModelForCausalLM.from_config(config)
            if run.lora:
                _lora_wrap(self.model)
            if run.norm == "fused_rmsnorm":
                _fuse_norms(self.model)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            params = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.AdamW(params, lr=1e-4)

    return Published


def token_batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def target_of(run: Run) -> Any:
    from lightning_pilot.estimate import Target

    if run.target == _H100_96["name"]:
        return Target(**_H100_96)  # type: ignore[arg-type]
    return run.target


def estimate_run(run: Run) -> dict[str, Any]:
    """The estimate of ``run``: its peak over every phase, fits, the step-time band and the
    roofline's parts at 100 % (from the rows' ``notes``)."""
    from lightning_pilot.estimate import estimate

    started = time.perf_counter()
    result = estimate(
        factory=factory(run),
        batch=token_batch(MODELS[run.model][1]["vocab_size"]),
        targets=[target_of(run)],
        precisions=[run.precision],
        micro_batches=[run.micro_batch],
        seq_lens=[run.seq_len],
        checkpointing=[run.checkpointing],
        strategies=[run.strategy],
        largest=False,
        workers=1,
    )
    rows = [row for row in result.rows if row["status"] == "ok"]
    if not rows:
        bad = result.rows[0]
        return {"run": run.name, "status": bad["status"], "reason": bad["reason"]}
    found = re.search(
        r"roofline: (\S+) s compute-bound, (\S+) s memory-bound, (\S+) s collectives",
        rows[0]["notes"],
    )
    assert found is not None, rows[0]["notes"]
    compute, memory, comm = (float(value) for value in found.groups())
    return {
        "run": run.name,
        "status": "ok",
        "seconds": round(time.perf_counter() - started, 1),
        "allocated": max(row["peak_allocated_bytes"] for row in rows),
        "reserved": max(row["peak_reserved_bytes"] for row in rows),
        "fits": all(row["fits"] for row in rows),
        # What the tightest phase's live blocks and overhead leave of the GPU's reported memory.
        "headroom": min(row["headroom_bytes"] for row in rows),
        "gpu_memory": rows[0]["gpu_memory_bytes"],
        # The reserved estimate exceeds the GPU though the live blocks fit (fits.tight_note).
        "tight": any("tight: " in (row["notes"] or "") for row in rows),
        "phase": max(rows, key=lambda row: row["peak_allocated_bytes"])["phase"],
        "compute_s": compute,
        "memory_s": memory,
        "comm_s": comm,
        "band_s": (rows[0]["step_time_low_s"], rows[0]["step_time_high_s"]),
    }


def compare(run: Run, est: dict[str, Any]) -> dict[str, Any]:
    """The published figures beside the estimate, with the ratios."""
    row: dict[str, Any] = {"run": run.name, "role": run.role, "known": run.known}
    if est["status"] != "ok":
        row["error"] = est["reason"]
        return row
    unit = GB if run.unit == "GB" else GIB
    estimated = est["allocated"] if run.quantity == "allocated" else est["reserved"]
    row["estimate_memory"] = round(estimated / unit, 2)
    row["fits"] = est["fits"]
    row["tight"] = est["tight"]
    row["gpu_memory_gib"] = round(est["gpu_memory"] / GIB, 2)
    row["headroom_gib"] = round(est["headroom"] / GIB, 2)
    if run.memory == "OOM":
        row["published_memory"] = "OOM"
        row["oom_predicted"] = not est["fits"]
    elif run.memory is not None:
        row["published_memory"] = run.memory
        row["memory_ratio"] = round(estimated / unit / float(run.memory), 3)
        row["no_false_oom"] = est["fits"]
    if run.tps is not None:
        measured = run.micro_batch * run.seq_len / run.tps
        row["published_step_s"] = round(measured, 3)
        ideal = est["compute_s"] + est["memory_s"]
        row["ideal_step_s"] = round(ideal, 3)
        row["compute_s"] = round(est["compute_s"], 3)
        row["memory_s"] = round(est["memory_s"], 3)
        row["comm_s"] = round(est["comm_s"], 3)
        row["ideal_over_measured"] = round(ideal / measured, 3)
        low, high = est["band_s"]
        row["band_s"] = (round(low, 3), round(high, 3))
        row["in_band"] = low <= measured <= high
    return row


def main(argv: list[str]) -> None:
    if argv[:1] == ["--list"]:
        for run in RUNS:
            print(run.name)
        return
    chosen = [run for run in RUNS if not argv or run.name in argv]
    for run in chosen:
        print(json.dumps(compare(run, estimate_run(run))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
