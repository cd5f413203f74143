"""The trace for a GPU target follows CUDA's kernels, not the CPU's: CUDA autocast's lists
(https://pytorch.org/docs/stable/amp.html, "CUDA Ops that can autocast to float16 / float32";
``aten/src/ATen/autocast_mode.h``) and CUDA's fused dropout (``aten::native_dropout``, a
boolean mask saved; ``aten/src/ATen/native/Dropout.cpp``, ``native_functions.yaml``).

The CPU reference (``measure_cpu(cuda=True)``) runs the same emulation on real tensors, so
the exactness of the trace is still proven against real ones."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import pytest
import torch
from estimate_models import HFEncoder, class_batch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_pilot.estimate import PHASE_ORDER, Recorder, Session, grid, measure_cpu
from lightning_pilot.estimate.cuda import cuda_autocast, cuda_dropout
from lightning_pilot.estimate.grid import trace_configuration

LOW = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def encoder_saved(dtype: torch.dtype, cuda: bool) -> tuple[Counter[Any], int]:
    """What autograd saves in one training forward pass of a Bert encoder layer (eager
    attention, dropout 0.1) on fake tensors under autocast: ``(numel, dtype) -> count``, and
    the number of elements of the attention probabilities."""
    import transformers

    config = transformers.BertConfig(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        num_hidden_layers=1,
        attn_implementation="eager",
    )
    saved: Counter[Any] = Counter()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[(tensor.numel(), tensor.dtype)] += 1
        return tensor

    with FakeTensorMode(allow_non_fake_inputs=True), contextlib.ExitStack() as stack:
        layer = transformers.models.bert.modeling_bert.BertLayer(config).train()
        hidden = torch.randn(2, 24, 64, requires_grad=True)
        if cuda:
            stack.enter_context(cuda_autocast())
            stack.enter_context(cuda_dropout())
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", dtype=dtype),
        ):
            layer(hidden)
    return saved, 2 * 4 * 24 * 24


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_encoder_saves_softmax_in_float32_and_a_bool_dropout_mask(precision: str) -> None:
    low = LOW[precision]
    saved, probs = encoder_saved(low, cuda=True)
    # On CUDA: the softmax output (saved by softmax's backward) is float32; dropout keeps a
    # one-byte mask; the product with the values saves the low-precision cast of the
    # dropped-out probabilities (batched matmul): nothing else of T x T size.
    assert saved[(probs, torch.float32)] == 1
    assert saved[(probs, torch.bool)] == 1
    assert saved[(probs, low)] == 1
    assert sum(n for (numel, _), n in saved.items() if numel == probs) == 3
    # The matrix products run in the low precision: the linear layers save low-precision
    # casts of their (2 x 24) x 64 inputs (queries, keys, values, the attention's output).
    assert saved[(2 * 24 * 64, low)] >= 4
    # CPU autocast (what the trace ran before): softmax output and dropout noise both low.
    cpu, _ = encoder_saved(low, cuda=False)
    assert cpu[(probs, low)] == 3
    assert cpu[(probs, torch.float32)] == 0


def test_dropout_saves_one_byte_per_element() -> None:
    with FakeTensorMode(), Recorder() as recorder, cuda_dropout():
        x = torch.empty(1 << 20, requires_grad=True)
        recorder.begin("forward")
        with recorder.saved_hooks():
            y = torch.nn.functional.dropout(x, 0.1)
        bytes_saved = sum(n for s, n in recorder.live.values() if s in recorder.saved)
        assert y.shape == x.shape
    assert bytes_saved == 1 << 20  # a bool mask; CPU's dropout saves 4 bytes per element


def test_dropout_off_in_eval_and_at_zero() -> None:
    x = torch.randn(8)
    with cuda_dropout():
        assert torch.nn.functional.dropout(x, 0.1, training=False) is x
        assert torch.nn.functional.dropout(x, 0.0) is x
        assert torch.equal(torch.nn.functional.dropout(x, 1.0), torch.zeros(8))
        y = torch.nn.functional.dropout(torch.ones(10_000), 0.5)
    assert set(y.unique().tolist()) == {0.0, 2.0}


def test_emulation_is_removed_afterwards() -> None:
    x = torch.randn(4, 4)
    with cuda_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(x, -1).dtype == torch.float32
        assert torch.nn.functional.layer_norm(x, (4,)).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.bfloat16


def test_cuda_refuses_binary_cross_entropy_under_autocast() -> None:
    x = torch.rand(4)
    with (
        cuda_autocast(),
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(RuntimeError, match="unsafe to autocast"),
    ):
        torch.nn.functional.binary_cross_entropy(x, x)


class _Exact(Session):
    """``Session(cuda=True)`` without the 512-byte rounding: comparable with real tensors."""

    def _prepare(self, *args: Any, **kwargs: Any) -> None:
        kwargs["round_to"] = 1
        super()._prepare(*args, **kwargs)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_encoder_matches_real_tensors_under_the_cuda_policy(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = class_batch(rows=4, length=24)
    torch.manual_seed(0)
    sizes: dict[str, Any] = {"micro_batch": 4, "seq_len": 24, "precision": precision}
    real = measure_cpu(HFEncoder(), batch, cuda=True, **sizes)
    plain = measure_cpu(HFEncoder(), batch, **sizes)
    monkeypatch.setattr(grid, "Session", _Exact)
    torch.manual_seed(0)
    traced = trace_configuration(
        HFEncoder(), batch, micro_batch=4, seq_len=24, precision=precision, device="cuda"
    )
    for phase in PHASE_ORDER:
        # The same bytes in every phase (0 apart); 0.1 % allowed.
        assert abs(traced[phase].peak_bytes - real[phase]) <= 0.001 * real[phase], phase
    # The CUDA policy changes the forward pass (float32 softmax, bool masks).
    assert real["forward"] != plain["forward"]
