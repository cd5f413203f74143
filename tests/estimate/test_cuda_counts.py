"""The step time's inputs for a GPU target: a causal fused attention kernel does about half
the work of a full one (FlashAttention and the memory-efficient kernel skip the key blocks
after each query block), and an alias (``aten._unsafe_view``, what every ``F.linear`` on a
3-D input returns) moves no bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_pilot.estimate import PhaseTrace, Recorder
from lightning_pilot.estimate.cuda import cuda_attention
from lightning_pilot.estimate.recorder import causal_fraction


def attention(causal: bool, queries: int = 128, keys: int = 128) -> PhaseTrace:
    with FakeTensorMode(), Recorder() as recorder, cuda_attention():
        query = torch.empty(2, 4, queries, 16, requires_grad=True)
        key = torch.empty(2, 4, keys, 16, requires_grad=True)
        recorder.begin("attention")
        out = F.scaled_dot_product_attention(query, key, key, is_causal=causal)
        out.sum().backward()
        return recorder.end()


def test_causal_attention_counts_the_kept_half() -> None:
    full, causal = attention(False), attention(True)
    names = list(causal.names)
    forward = names.index("_scaled_dot_product_flash_attention_for_cpu.default")
    backward = names.index("_scaled_dot_product_flash_attention_for_cpu_backward.default")
    # 4 x 128 x 128 x 16 x 2 heads x batch 2: 8,388,608 forward FLOPs in full (QK^T and PV).
    assert int(full.flops[forward]) == 8_388_608
    assert int(causal.flops[forward]) == 8_388_608 * 129 // 256  # 128 x 129 / 2 of 128^2
    assert int(causal.flops[backward]) == int(full.flops[backward]) * 129 // 256
    assert int(causal.flops.sum()) < 0.51 * int(full.flops.sum())


@pytest.mark.parametrize(("queries", "keys", "kept"), [(4, 4, 10), (2, 4, 3), (4, 2, 7)])
def test_causal_fraction_counts_top_left_pairs(queries: int, keys: int, kept: int) -> None:
    assert causal_fraction(queries, keys) == kept / (queries * keys)


def test_unsafe_view_of_a_3d_linear_moves_no_bytes() -> None:
    with FakeTensorMode(), Recorder() as recorder:
        x, weight = torch.empty(2, 8, 16), torch.empty(32, 16)
        recorder.begin("linear")
        F.linear(x, weight)
        trace = recorder.end()
    moved = dict(zip(trace.names, trace.moved.tolist(), strict=True))
    assert moved["_unsafe_view.default"] == 0
    assert moved["mm.default"] == (16 * 16 + 32 * 16 + 16 * 32) * 4  # read x, w; write out
    assert int(trace.moved.sum()) == moved["mm.default"]
