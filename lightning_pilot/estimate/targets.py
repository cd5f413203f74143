"""Target GPUs: memory, peak dense arithmetic per precision, memory and link bandwidth.

Peak FLOP/s and bandwidths in :data:`TARGETS` are the vendor's datasheet values for dense
arithmetic (no 2:4 sparsity), the datasheet named in ``source``.

:attr:`Target.memory_bytes` is the memory the device reports,
``torch.cuda.get_device_properties(i).total_memory`` (``cudaDeviceProp.totalGlobalMem``, the
"total capacity" of PyTorch's out-of-memory message), not the datasheet's: the driver keeps
part of it, and on GDDR6 cards with ECC on (L4, A10G, L40S) ``nvidia-smi`` already shows only
15/16 of the nominal. An A100-SXM4-40GB reports 40,339 MiB of its nominal 40,960, an
A100-SXM4-80GB 81,051 of 81,920; each entry cites its published report in ``memory_source``.
The figure moves with the driver by a few hundred MiB, so pass ``memory=`` (the machine's
``total_memory``) for yours. Where only ``nvidia-smi``'s total was found, the entry says so:
it counts memory current drivers keep from CUDA, so it is an upper bound.

``overhead_bytes`` is what a training process holds outside PyTorch's allocator (the CUDA
context, the kernels' module images, the libraries' own allocations): 512 MiB by default, an
allowance at the top of what PyTorch's own out-of-memory messages show for single-GPU processes
(0.40 to 0.49 GiB on A100 and L40 cards, ``docs/estimate-validation.md``); NCCL's buffers are
not modelled. ``workspace_bytes`` (cuBLAS/cuBLASLt workspaces, taken from the caching
allocator, so part of the allocated figure) follows PyTorch's default
``CUBLAS_WORKSPACE_CONFIG``: ``:4096:8`` (32 MiB) on Hopper, ``:4096:2:16:8`` (about 8 MiB)
before. Replace either through :class:`Target` when you have your own figures.

Example:
    >>> TARGETS["A100-40GB"].memory_bytes  # deviceQuery, driver 535 (CUDA 12.2), ECC on
    42298834944
    >>> TARGETS["A100-40GB"].memory_bytes < 40 * 2**30  # less than the datasheet's 40 GiB
    True
    >>> custom = Target("my-gpu", memory="48GiB", fp32=40e12, tf32=80e12, bf16=160e12,
    ...                 fp16=160e12, bandwidth=900e9)
    >>> custom.peak(torch.bfloat16) == 160e12
    True
"""

from __future__ import annotations

from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any, Final

import torch

from lightning_pilot.core import validate

_MIB: Final = 2**20
_GIB: Final = 2**30


@dataclass(frozen=True)
class Target:
    """One GPU model: what the estimate needs to know about it.

    ``memory`` is bytes (an int) or a size string (``"80GiB"``): what the device reports
    (``torch.cuda.get_device_properties(i).total_memory``), not the datasheet's capacity;
    ``fp32``, ``tf32``, ``bf16``, ``fp16`` are peak dense FLOP/s; ``bandwidth`` is memory
    bytes/s; ``link`` is the bytes/s one GPU sends to the others in a collective (NVLink or
    PCIe, one direction); ``source`` names where the arithmetic and bandwidth figures come
    from, ``memory_source`` where the memory figure does.

    Example:
        >>> Target("x", memory="24GB", fp32=1e12, tf32=1e12, bf16=2e12, fp16=2e12,
        ...        bandwidth=0)
        Traceback (most recent call last):
        ...
        ValueError: Target(bandwidth=0) is invalid: expected a finite number > 0.
    """

    name: str
    memory_bytes: int = field(init=False)
    _: KW_ONLY
    memory: InitVar[int | str]
    fp32: float
    tf32: float
    bf16: float
    fp16: float
    bandwidth: float
    link: float = 32e9
    overhead_bytes: int = 512 * _MIB
    workspace_bytes: int = 8 * _MIB + 128 * 1024
    source: str = "user"
    memory_source: str = "user"

    def __post_init__(self, memory: int | str) -> None:
        owner = "Target"
        set_ = object.__setattr__
        set_(self, "name", validate.text(owner, "name", self.name, max_length=100))
        if isinstance(memory, str):
            size = validate.parse_size(memory, "Target(memory)")
        else:
            size = validate.integer(owner, "memory", memory, minimum=1)
        set_(self, "memory_bytes", size)
        for attr in ("fp32", "tf32", "bf16", "fp16", "bandwidth", "link"):
            rate = validate.number(owner, attr, getattr(self, attr), minimum=0, allow_minimum=False)
            set_(self, attr, rate)
        for attr in ("overhead_bytes", "workspace_bytes"):
            set_(self, attr, validate.integer(owner, attr, getattr(self, attr), minimum=0))
        for attr in ("source", "memory_source"):
            set_(self, attr, validate.text(owner, attr, getattr(self, attr)))

    def peak(self, dtype: torch.dtype, *, allow_tf32: bool = False) -> float:
        """Peak dense FLOP/s of matrix products in ``dtype`` (fp32 runs on TF32 tensor cores
        only when ``allow_tf32``: ``torch.set_float32_matmul_precision("high")``)."""
        if dtype == torch.bfloat16:
            return self.bf16
        if dtype == torch.float16:
            return self.fp16
        return self.tf32 if allow_tf32 else self.fp32


def _t(
    name: str, memory: int, tflops: tuple[float, float, float, float], tb_s: float, **kw: Any
) -> Target:
    """A catalogue entry in datasheet units: TFLOP/s (fp32, tf32, bf16, fp16) and TB/s."""
    fp32, tf32, bf16, fp16 = (value * 1e12 for value in tflops)
    bandwidth = tb_s * 1e12
    return Target(
        name, memory=memory, fp32=fp32, tf32=tf32, bf16=bf16, fp16=fp16, bandwidth=bandwidth, **kw
    )


def _gib(printed: float) -> int:
    """The bytes of a capacity PyTorch's out-of-memory message prints in GiB to two decimals
    ("GPU 0 has a total capacity of 79.11 GiB"): within 5 MiB of the device's figure."""
    return round(printed * _GIB)


_HOPPER_WORKSPACE: Final = 32 * _MIB
#: An 80 GB H100 as PyTorch reports it: "GPU 0 has a total capacity of 79.11 GiB"
#: (vllm-project/vllm#27508, 2025, running openai/gpt-oss-120b on one "H100"; the thread's
#: excerpt does not name the form factor, and both the SXM5 and the PCIe card carry 80 GB).
_H100_80: Final = _gib(79.11)
_H100_80_SOURCE: Final = (
    "PyTorch out-of-memory message, 'total capacity of 79.11 GiB', an 80 GB H100 (form factor"
    " not stated): https://github.com/vllm-project/vllm/issues/27508"
)
#: The catalogue. Peak FLOP/s are dense (the datasheets print sparse figures at twice these);
#: ``link`` is one direction of NVLink (half the datasheet's bidirectional figure) or of a
#: PCIe x16 link (Gen4 32 GB/s, Gen5 64 GB/s); ``memory`` is the device's own report (module
#: docstring), each cited in ``memory_source``.
TARGETS: Final[dict[str, Target]] = {
    t.name: t
    for t in (
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67 TF, TF32 989 TF sparse,
        # BF16/FP16 1,979 TF sparse, HBM3 3.35 TB/s, NVLink 900 GB/s; 80 GB.
        _t(
            "H100-SXM-80GB",
            _H100_80,
            (67, 494.5, 989.5, 989.5),
            3.35,
            link=450e9,
            workspace_bytes=_HOPPER_WORKSPACE,
            source="NVIDIA H100 datasheet, SXM5",
            memory_source=_H100_80_SOURCE,
        ),
        # Same datasheet, PCIe: FP32 51 TF, TF32 756 sparse, BF16/FP16 1,513 sparse, 2 TB/s;
        # 80 GB. No report naming the PCIe card was found: the 80 GB H100's above.
        _t(
            "H100-PCIe-80GB",
            _H100_80,
            (51, 378, 756.5, 756.5),
            2.0,
            link=64e9,
            workspace_bytes=_HOPPER_WORKSPACE,
            source="NVIDIA H100 datasheet, PCIe",
            memory_source=_H100_80_SOURCE + " (no report naming the PCIe card found)",
        ),
        # NVIDIA H200 datasheet (SXM): compute as H100 SXM, 141 GB HBM3e, 4.8 TB/s. PyTorch
        # prints total_memory's MiB as "MB".
        _t(
            "H200-SXM-141GB",
            143156 * _MIB,
            (67, 494.5, 989.5, 989.5),
            4.8,
            link=450e9,
            workspace_bytes=_HOPPER_WORKSPACE,
            source="NVIDIA H200 datasheet, SXM",
            memory_source=(
                "torch get_device_properties, 'NVIDIA H200', total_memory=143156MB:"
                " https://github.com/ai-bot-pro/achatbot/blob/298019b35ebdd32d4ec0daae998b2308"
                "099ba77c/deploy/modal/src/llm/vllm/vlm/skywork_r1v.py"
            ),
        ),
        # NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5, TF32 156, BF16/FP16 312 (dense);
        # 80GB SXM 2,039 GB/s, 40GB 1,555 GB/s; NVLink 600 GB/s. nvidia-smi shows 81,920 MiB.
        _t(
            "A100-SXM-80GB",
            81051 * _MIB,
            (19.5, 156, 312, 312),
            2.039,
            link=300e9,
            source="NVIDIA A100 datasheet, 80GB SXM",
            memory_source=(
                "torch total_memory as Ultralytics prints it, 'NVIDIA A100-SXM4-80GB, 81051MiB',"
                " torch 2.9.1+cu128: https://github.com/ultralytics/ultralytics/issues/22877"
            ),
        ),
        # A 2021 report under an older driver read 40,537 MiB (ultralytics/yolov5#3360).
        _t(
            "A100-40GB",
            42298834944,
            (19.5, 156, 312, 312),
            1.555,
            link=300e9,
            source="NVIDIA A100 datasheet, 40GB",
            memory_source=(
                "deviceQuery, 'NVIDIA A100-SXM4-40GB', driver CUDA 12.2, ECC enabled,"
                " 42298834944 bytes: https://github.com/bottlerocket-os/bottlerocket/pull/3873"
            ),
        ),
        # NVIDIA L40S datasheet: FP32 91.6, TF32 366 sparse, BF16/FP16 733 sparse, 864 GB/s,
        # 48 GB GDDR6 with ECC (a sixteenth: nvidia-smi shows 46,068 MiB of 49,152), PCIe Gen4.
        _t(
            "L40S-48GB",
            _gib(44.53),
            (91.6, 183, 366.5, 366.5),
            0.864,
            link=32e9,
            source="NVIDIA L40S datasheet",
            memory_source=(
                "PyTorch out-of-memory message on an 'L40S 48GB', 'total capacity of 44.53 GiB':"
                " https://github.com/Wan-Video/Wan2.1/issues/205"
            ),
        ),
        # NVIDIA L4 datasheet: FP32 30.3, TF32 120 sparse, BF16/FP16 242 sparse, 300 GB/s,
        # 24 GB GDDR6 (ECC on), PCIe Gen4 x16.
        _t(
            "L4-24GB",
            23034 * _MIB,
            (30.3, 60, 121, 121),
            0.300,
            link=32e9,
            source="NVIDIA L4 datasheet",
            memory_source=(
                "nvidia-smi total 23034MiB for 'L4' (an upper bound of torch's total_memory; no"
                " torch report found): https://github.com/modal-labs/modal-client/pull/2797"
            ),
        ),
        # AWS's A10G has no NVIDIA datasheet of its own: these are the NVIDIA A10 datasheet's
        # figures (FP32 31.2, TF32 62.5, BF16/FP16 125 dense, 600 GB/s, 24 GB), an upper bound.
        _t(
            "A10G-24GB",
            _gib(22.20),
            (31.2, 62.5, 125, 125),
            0.600,
            link=32e9,
            source="NVIDIA A10 datasheet (A10G: AWS variant, upper bound)",
            memory_source=(
                "PyTorch out-of-memory message on a g5.12xlarge (A10G), '22.20 GiB total"
                " capacity': https://github.com/XavierXiao/Dreambooth-Stable-Diffusion/issues/18"
            ),
        ),
        # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: FP32 82.6, TF32 82.6,
        # FP16/BF16 tensor with FP32 accumulate 165.2 (dense), GDDR6X 1,008 GB/s, 24 GB; ECC was
        # off in the cited deviceQuery.
        _t(
            "RTX-4090-24GB",
            25386352640,
            (82.6, 82.6, 165.2, 165.2),
            1.008,
            link=32e9,
            source="NVIDIA Ada Lovelace architecture whitepaper, RTX 4090",
            memory_source=(
                "deviceQuery, 'NVIDIA GeForce RTX 4090', driver CUDA 12.4, 25386352640 bytes:"
                " https://github.com/thamada/nvidia-smi/blob/b09ef139265ffc7e3c78006346981de8e4d"
                "70499/gls/RTX4090_deviceQuery.py"
            ),
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
    expected = "a Target or one of " + ", ".join(sorted(TARGETS))
    error = ValueError if isinstance(value, str) else TypeError
    raise error(validate.invalid("estimate", "targets", value, expected))
