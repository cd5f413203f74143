"""Tracing fewer repeated blocks: the extrapolation to every block is proven against full
traces (operator by operator, every phase, checkpointing on and off), the module is given
back exactly, and a module whose cut fails is traced in full and says so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from estimate_models import HFCausalLM, token_batch, transformer_batch
from torch import nn

from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.estimate import PHASE_ORDER, Session, estimate
from lightning_pilot.estimate import blocks as estimate_blocks
from lightning_pilot.estimate.recorder import operator_signature

# Cut to 3, 4 and 5 blocks and extrapolated to 6 (kept small for CI; at 32 and 80 blocks,
# `python benchmarks/estimate.py case 7b-blocks-check` / `70b-blocks-check` compare the rows).
LAYERS = 6


def _gpt2() -> Any:
    import transformers

    module = HFCausalLM("gpt2")
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=64, n_embd=32, n_layer=LAYERS, n_head=2
    )
    module.model = transformers.GPT2LMHeadModel(config)
    return module


def _llama() -> Any:
    import transformers

    module = HFCausalLM("llama")
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    module.model = transformers.LlamaForCausalLM(config)
    return module


def _demo_lm() -> Any:
    return TinyCausalLM(d_model=32, n_heads=2, n_layers=LAYERS, max_length=32)


def _transformer() -> Any:
    from lightning.pytorch.demos import LightningTransformer, Transformer

    module = LightningTransformer(vocab_size=64)
    module.model = Transformer(
        vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=LAYERS, dropout=0.0
    )
    return module


def _demo_batch() -> Any:
    data = InstructionDataModule(batch_size=4, max_length=32, seed=0)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _block_class(module: nn.Module) -> list[type[nn.Module]]:
    found = estimate_blocks.repeated_blocks(module)
    assert found is not None
    return [type(next(iter(found[1]._modules.values())))]


def test_repeated_blocks_finds_the_list_of_sixteen_equal_blocks() -> None:
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(16))
    found = estimate_blocks.repeated_blocks(nn.Sequential(nn.Linear(4, 4), layers))
    assert found is not None
    assert found[0] == "1"


def test_a_whole_range_slice_has_the_slice_signature() -> None:
    alias = operator_signature(["alias.default", "mm.default"])
    assert alias == operator_signature(["slice.Tensor", "mm.default"])


# name -> (module factory, batch factory, sequence length, checkpoint classes needed)
MODELS: dict[str, tuple[Callable[[], Any], Callable[[], Any], int, bool]] = {
    "gpt2": (_gpt2, token_batch, 16, False),
    "llama": (_llama, token_batch, 16, False),
    "demo_lm": (_demo_lm, _demo_batch, 32, True),
    "lightning_transformer": (_transformer, transformer_batch, 12, True),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_block_extrapolation_equals_the_full_trace(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(estimate_blocks, "MIN_BLOCKS", LAYERS)
    make, batch_of, seq_len, needs_classes = MODELS[name]
    batch = batch_of()
    module = make()
    container = estimate_blocks.repeated_blocks(module)
    assert container is not None
    assert len(container[1]._modules) > max(estimate_blocks.CUTS)
    blocks_before = container[1].__dict__["_modules"]
    order_before = list(blocks_before.items())
    classes = _block_class(module) if needs_classes else []
    got: dict[bool, dict[tuple[bool, str], Any]] = {}
    for blocks in (True, False):
        got[blocks] = {}
        with Session(
            module,
            precision="bf16-mixed",
            round_to=512,
            cuda=True,
            checkpoint_classes=classes,
            blocks=blocks,
        ) as session:
            for checkpointing in (False, True):
                phases = session.train_phases(
                    batch, micro_batch=2, seq_len=seq_len, checkpointing=checkpointing
                )
                for phase, value in phases.items():
                    got[blocks][(checkpointing, phase)] = value
            if name != "lightning_transformer":
                # nn.TransformerEncoder's inference fast path is no repeat of one block: its
                # validation is traced in full (and says so; see the test below).
                got[blocks][(False, "validation")] = session.validation_phase(
                    batch, micro_batch=2, seq_len=seq_len
                )
    for key, full in got[False].items():
        cut = got[True][key]
        where = (name, *key)
        assert any("blocks: traced with" in note for note in cut.notes), where
        # Exact, operator by operator: the sequence, live bytes, FLOPs, bytes moved.
        assert cut.signature == full.signature, where
        assert np.array_equal(cut.curve, full.curve), where
        assert np.array_equal(cut.flops, full.flops), where
        assert np.array_equal(cut.moved, full.moved), where
        assert np.array_equal(cut.kinds, full.kinds), where
        # The allocations the allocator cache replays (estimate.cache), operator by operator.
        assert len(full.requests) == len(full.curve), where
        assert full.request_count.sum() > 0, where
        assert np.array_equal(cut.requests, full.requests), where
        assert np.array_equal(cut.request_count, full.request_count), where
        assert np.array_equal(cut.grad_requests, full.grad_requests), where
        assert cut.peak_bytes == full.peak_bytes > 0, where
        assert cut.categories == full.categories, where
        assert cut.segment_bytes == full.segment_bytes, where
    # No trace: the very same block dictionary, the same blocks in the same order.
    assert container[1].__dict__["_modules"] is blocks_before
    assert list(blocks_before.items()) == order_before


class CountsItsLayers(nn.Module):
    """A module that checks its own depth: cut, it refuses, so it is traced in full."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(16))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if len(self.layers) != 16:
            raise RuntimeError("expected 16 layers")
        x = batch[0]
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.square().mean()

    validation_step = training_step

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_cut_that_fails_is_traced_in_full_and_says_so() -> None:
    batch = (torch.randn(4, 8),)
    rows = estimate(CountsItsLayers(), batch, micro_batches=[2], largest=False, workers=1).rows
    assert {row["status"] for row in rows} == {"ok"}
    forward = next(row for row in rows if row["phase"] == "forward")
    assert "blocks: traced in full (16 blocks of layers)" in forward["notes"]
    assert "RuntimeError: expected 16 layers" in forward["notes"]


def test_checkpointing_without_classes_fails_only_its_own_rows() -> None:
    # The demo LM has no Hugging Face model inside: checkpointing needs checkpoint_classes.
    result = estimate(
        TinyCausalLM(max_length=32),
        _demo_batch(),
        micro_batches=[2],
        seq_lens=[32],
        checkpointing=[False, True],
        workers=1,
    )
    frame = result.frame()
    plain = frame[~frame.checkpointing]
    assert set(plain.status) == {"ok"}
    assert len(plain) == len(PHASE_ORDER)
    (failed,) = frame[frame.checkpointing].itertuples()
    assert failed.status == "error"
    assert "checkpoint_classes=[YourBlock]" in failed.reason
    assert "--checkpoint-class" in failed.reason
    assert failed.peak_allocated_bytes is None or np.isnan(failed.peak_allocated_bytes)
    largest = result.largest_frame().set_index("checkpointing")
    assert largest.loc[False, "status"] == "ok"
    assert largest.loc[False, "largest_micro_batch"] > 0
    assert largest.loc[True, "status"] == "error"
    assert "checkpoint_classes" in largest.loc[True, "reason"]


def test_memory_in_the_sequence_length_is_the_quadratic_of_three_traces() -> None:
    from lightning_pilot.estimate.searches import _lagrange

    # The demo LM builds T x T masks: memory is not linear in the sequence length.
    batch = _demo_batch()
    lengths = (64, 128, 192, 256)
    with Session(TinyCausalLM(max_length=256), precision="32-true", round_to=512, cuda=True) as s:
        traced = {}
        for seq in lengths:
            phases = s.train_phases(batch, micro_batch=2, seq_len=seq)
            phases["validation"] = s.validation_phase(batch, micro_batch=2, seq_len=seq)
            traced[seq] = phases
    for phase in ("forward", "backward", "validation"):
        points = [traced[seq][phase].curve for seq in lengths[:3]]
        predicted = _lagrange(lengths[:3], points, 256)
        # Exact, operator by operator, at a length none of the three traced.
        assert np.array_equal(np.rint(predicted), traced[256][phase].curve), phase
        # A straight line through two of them is not.
        line = _lagrange(lengths[:2], points[:2], 256)
        assert not np.array_equal(np.rint(line), traced[256][phase].curve), phase
