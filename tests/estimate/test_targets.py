"""The target catalogue's memory: what each device reports, each figure cited
(``lightning_pilot.estimate.targets``), never the datasheet's nominal capacity."""

from __future__ import annotations

import pytest

from lightning_pilot.estimate import TARGETS, Target

GIB = 2**30
MIB = 2**20

#: The datasheet's capacity of each catalogue GPU ("80GB"), read as GiB: more than any
#: device reports.
NOMINAL_GIB = {
    "H100-SXM-80GB": 80,
    "H100-PCIe-80GB": 80,
    "H200-SXM-141GB": 141,
    "A100-SXM-80GB": 80,
    "A100-40GB": 40,
    "L40S-48GB": 48,
    "L4-24GB": 24,
    "A10G-24GB": 24,
    "RTX-4090-24GB": 24,
}


def test_every_catalogue_gpu_has_a_cited_device_report_below_its_datasheet_capacity() -> None:
    assert set(TARGETS) == set(NOMINAL_GIB)
    for name, tgt in TARGETS.items():
        assert "https://github.com/" in tgt.memory_source, (name, tgt.memory_source)
        # The driver keeps some memory (and ECC a sixteenth of GDDR6): 0.8 to 7.5 % below.
        share = tgt.memory_bytes / (NOMINAL_GIB[name] * GIB)
        assert 0.92 < share < 0.995, (name, share)
        assert tgt.overhead_bytes == 512 * MIB


@pytest.mark.parametrize(
    ("name", "reported"),
    [
        ("A100-40GB", 42_298_834_944),  # deviceQuery: "40339 MBytes (42298834944 bytes)"
        ("RTX-4090-24GB", 25_386_352_640),  # deviceQuery: "24210 MBytes (25386352640 bytes)"
        ("A100-SXM-80GB", 81_051 * MIB),  # torch total_memory, "81051MiB"
        ("H200-SXM-141GB", 143_156 * MIB),  # torch total_memory, "total_memory=143156MB"
    ],
)
def test_exact_device_reports_are_taken_as_printed(name: str, reported: int) -> None:
    assert TARGETS[name].memory_bytes == reported


def test_a_gpu_of_your_own_carries_its_memory_source() -> None:
    mine = Target(
        "mine",
        memory="22GiB",
        fp32=1e12,
        tf32=1e12,
        bf16=2e12,
        fp16=2e12,
        bandwidth=1e11,
        memory_source="torch.cuda.get_device_properties(0).total_memory on our node",
    )
    assert mine.memory_bytes == 22 * GIB
    assert Target("x", memory=1, fp32=1, tf32=1, bf16=1, fp16=1, bandwidth=1).memory_source == (
        "user"
    )
    with pytest.raises(ValueError, match=r"Target\(memory_source=' '\) is invalid"):
        Target("x", memory=1, fp32=1, tf32=1, bf16=1, fp16=1, bandwidth=1, memory_source=" ")
