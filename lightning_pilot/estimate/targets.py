"""Target GPUs: memory, peak dense arithmetic per precision, memory and link bandwidth.

Every figure in :data:`TARGETS` is the vendor's datasheet value for dense arithmetic (no 2:4
sparsity), with the datasheet named beside it. Memory is the datasheet's capacity in GiB (what
NVIDIA calls "80GB" is 80 GiB of HBM); the driver reports a little less (a few hundred MiB
held for ECC and the driver), which :attr:`Target.overhead_bytes` covers together with the
CUDA context.

``overhead_bytes`` (the CUDA context, the kernels' module images and the library handles,
outside PyTorch's allocator and so outside ``torch.cuda.max_memory_allocated``) and
``workspace_bytes`` (cuBLAS/cuBLASLt workspaces, which PyTorch takes from its caching allocator
at the first matrix product, so they *are* in the allocated figure) are allowances, not
measurements: 512 MiB of context is the order of what ``nvidia-smi`` shows for an idle
PyTorch process with lazy module loading (CUDA 11.7+); the workspace follows PyTorch's default
``CUBLAS_WORKSPACE_CONFIG`` (``:4096:8``, 32 MiB, on Hopper; ``:4096:2:16:8``, about 8 MiB,
before). Replace them with your own figures through :class:`Target` when you have them.

Example:
    >>> TARGETS["H100-SXM-80GB"].memory_bytes // 2**30
    80
    >>> custom = Target("my-gpu", memory="48GiB", fp32=40e12, tf32=80e12, bf16=160e12,
    ...                 fp16=160e12, bandwidth=900e9)
    >>> custom.peak(torch.bfloat16) == 160e12
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from lightning_pilot.core import validate

__all__ = ["TARGETS", "Target", "target"]

_MIB: Final = 2**20
_GIB: Final = 2**30


@dataclass(frozen=True, init=False)
class Target:
    """One GPU model: what the estimate needs to know about it.

    ``memory`` is bytes (an int) or a size string (``"80GiB"``); ``fp32``, ``tf32``, ``bf16``,
    ``fp16`` are peak dense FLOP/s; ``bandwidth`` is memory bytes/s; ``link`` is the bytes/s
    one GPU sends to the others in a collective (NVLink or PCIe, one direction); ``source``
    names where the figures come from.

    Example:
        >>> Target("x", memory="24GB", fp32=1e12, tf32=1e12, bf16=2e12, fp16=2e12,
        ...        bandwidth=0)
        Traceback (most recent call last):
        ...
        ValueError: Target(bandwidth=0) is invalid: expected a finite number > 0.
    """

    name: str
    memory_bytes: int
    fp32: float
    tf32: float
    bf16: float
    fp16: float
    bandwidth: float
    link: float
    overhead_bytes: int
    workspace_bytes: int
    source: str

    def __init__(
        self,
        name: str,
        *,
        memory: int | str,
        fp32: float,
        tf32: float,
        bf16: float,
        fp16: float,
        bandwidth: float,
        link: float = 32e9,
        overhead_bytes: int = 512 * _MIB,
        workspace_bytes: int = 8 * _MIB + 128 * 1024,
        source: str = "user",
    ) -> None:
        owner = "Target"
        set_ = object.__setattr__
        set_(self, "name", validate.text(owner, "name", name, max_length=100))
        if isinstance(memory, str):
            size = validate.parse_size(memory, "Target(memory)")
        else:
            size = validate.integer(owner, "memory", memory, minimum=1)
        set_(self, "memory_bytes", size)
        for field in ("fp32", "tf32", "bf16", "fp16", "bandwidth", "link"):
            value = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16}.get(
                field, bandwidth if field == "bandwidth" else link
            )
            set_(self, field, validate.number(owner, field, value, minimum=0, allow_minimum=False))
        set_(
            self,
            "overhead_bytes",
            validate.integer(owner, "overhead_bytes", overhead_bytes, minimum=0),
        )
        set_(
            self,
            "workspace_bytes",
            validate.integer(owner, "workspace_bytes", workspace_bytes, minimum=0),
        )
        set_(self, "source", validate.text(owner, "source", source))

    def peak(self, dtype: torch.dtype, *, allow_tf32: bool = False) -> float:
        """Peak dense FLOP/s of matrix products in ``dtype`` (fp32 runs on TF32 tensor cores
        only when ``allow_tf32``: ``torch.set_float32_matmul_precision("high")``)."""
        if dtype == torch.bfloat16:
            return self.bf16
        if dtype == torch.float16:
            return self.fp16
        return self.tf32 if allow_tf32 else self.fp32


def _t(
    name: str, gib: int, tflops: tuple[float, float, float, float], tb_s: float, **kw: object
) -> Target:
    fp32, tf32, bf16, fp16 = (value * 1e12 for value in tflops)
    return Target(
        name,
        memory=gib * _GIB,
        fp32=fp32,
        tf32=tf32,
        bf16=bf16,
        fp16=fp16,
        bandwidth=tb_s * 1e12,
        **kw,  # type: ignore[arg-type]
    )


_HOPPER_WORKSPACE: Final = 32 * _MIB
#: The catalogue. Peak FLOP/s are dense (the datasheets print sparse figures at twice these);
#: ``link`` is one direction of NVLink (half the datasheet's bidirectional figure) or of a
#: PCIe x16 link (Gen4 32 GB/s, Gen5 64 GB/s).
TARGETS: Final[dict[str, Target]] = {
    t.name: t
    for t in (
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67 TF, TF32 989 TF sparse,
        # BF16/FP16 1,979 TF sparse, HBM3 3.35 TB/s, NVLink 900 GB/s.
        _t(
            "H100-SXM-80GB",
            80,
            (67, 494.5, 989.5, 989.5),
            3.35,
            link=450e9,
            workspace_bytes=_HOPPER_WORKSPACE,
            source="NVIDIA H100 datasheet, SXM5",
        ),
        # Same datasheet, PCIe: FP32 51 TF, TF32 756 sparse, BF16/FP16 1,513 sparse, 2 TB/s.
        _t(
            "H100-PCIe-80GB",
            80,
            (51, 378, 756.5, 756.5),
            2.0,
            link=64e9,
            workspace_bytes=_HOPPER_WORKSPACE,
            source="NVIDIA H100 datasheet, PCIe",
        ),
        # NVIDIA H200 datasheet (SXM): compute as H100 SXM, 141 GB HBM3e, 4.8 TB/s.
        _t(
            "H200-SXM-141GB",
            141,
            (67, 494.5, 989.5, 989.5),
            4.8,
            link=450e9,
            workspace_bytes=_HOPPER_WORKSPACE,
            source="NVIDIA H200 datasheet, SXM",
        ),
        # NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5, TF32 156, BF16/FP16 312 (dense);
        # 80GB SXM 2,039 GB/s, 40GB 1,555 GB/s; NVLink 600 GB/s.
        _t(
            "A100-SXM-80GB",
            80,
            (19.5, 156, 312, 312),
            2.039,
            link=300e9,
            source="NVIDIA A100 datasheet, 80GB SXM",
        ),
        _t(
            "A100-40GB",
            40,
            (19.5, 156, 312, 312),
            1.555,
            link=300e9,
            source="NVIDIA A100 datasheet, 40GB",
        ),
        # NVIDIA L40S datasheet: FP32 91.6, TF32 366 sparse, BF16/FP16 733 sparse, 864 GB/s,
        # 48 GB GDDR6, PCIe Gen4 x16.
        _t(
            "L40S-48GB",
            48,
            (91.6, 183, 366.5, 366.5),
            0.864,
            link=32e9,
            source="NVIDIA L40S datasheet",
        ),
        # NVIDIA L4 datasheet: FP32 30.3, TF32 120 sparse, BF16/FP16 242 sparse, 300 GB/s,
        # 24 GB, PCIe Gen4 x16.
        _t("L4-24GB", 24, (30.3, 60, 121, 121), 0.300, link=32e9, source="NVIDIA L4 datasheet"),
        # AWS's A10G has no NVIDIA datasheet of its own: these are the NVIDIA A10 datasheet's
        # figures (FP32 31.2, TF32 62.5, BF16/FP16 125 dense, 600 GB/s, 24 GB), an upper bound.
        _t(
            "A10G-24GB",
            24,
            (31.2, 62.5, 125, 125),
            0.600,
            link=32e9,
            source="NVIDIA A10 datasheet (A10G: AWS variant, upper bound)",
        ),
        # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: FP32 82.6, TF32 82.6,
        # FP16/BF16 tensor with FP32 accumulate 165.2 (dense), GDDR6X 1,008 GB/s, 24 GB.
        _t(
            "RTX-4090-24GB",
            24,
            (82.6, 82.6, 165.2, 165.2),
            1.008,
            link=32e9,
            source="NVIDIA Ada Lovelace architecture whitepaper, RTX 4090",
        ),
    )
}


def target(value: object) -> Target:
    """A :class:`Target`, or the catalogue's entry named ``value``.

    Example:
        >>> target("L4-24GB").bandwidth
        300000000000.0
    """
    if isinstance(value, Target):
        return value
    if isinstance(value, str) and value in TARGETS:
        return TARGETS[value]
    raise (TypeError if not isinstance(value, str) else ValueError)(
        validate.invalid(
            "estimate", "targets", value, "a Target or one of " + ", ".join(sorted(TARGETS))
        )
    )
