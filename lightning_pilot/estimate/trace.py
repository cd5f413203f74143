"""Trace a LightningModule's training phases on fake tensors: memory per phase, by category.

A :class:`Session` holds the user's module with its parameters replaced by fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and storages, no data, no
memory) and the optimizer its own ``configure_optimizers`` builds. Each phase runs the module's
own code under a :class:`Recorder`, a dispatch mode that follows every storage operators touch
(as the CPU :class:`~lightning_pilot.core.memory.TensorTracker` does on real tensors) and
records, per operator, the live bytes after it, its FLOPs and the bytes it reads and writes.

What the trace sees (a storage is counted once, views share one; bytes are freed when Python
frees the last reference, exactly as on real tensors):

- ``weights``: parameters and buffers; ``gradients``: ``.grad`` tensors; ``optimizer_state``:
  tensors in the optimizer's ``state``; ``batch``: the batch's tensors;
- ``activations``: tensors autograd saves for the backward pass
  (``torch.autograd.graph.saved_tensors_hooks``) and what the graph still holds at the end of
  the forward pass (the inputs kept by activation checkpointing);
- ``temporaries``: the rest of the peak.

The categories of a phase are those of the storages live at its peak, so they add up to the
peak exactly.

Values the step reads back from the data (``int(mask.sum())``, ``attention_mask.all()``,
``nonzero`` on labels) are computed from the real batch: integer and boolean tensors derived
only from the batch carry a real copy ("shadow"), reshaped to the traced size. A step that reads
a value computed from the model's floats (``loss.item()`` inside ``training_step``,
``nonzero`` on logits) cannot be traced: :class:`UntraceableError` names the operator and the
workaround.

The trace is built from one module per concern, all re-exported here:
:mod:`~lightning_pilot.estimate.session` (the :class:`Session`),
:mod:`~lightning_pilot.estimate.recorder` (the dispatch recorder, FLOPs, segments),
:mod:`~lightning_pilot.estimate.shadows` (real copies of batch-derived values),
:mod:`~lightning_pilot.estimate.precision`, :mod:`~lightning_pilot.estimate.batches`,
:mod:`~lightning_pilot.estimate.optimizers`, :mod:`~lightning_pilot.estimate.cuda` (CUDA's
attention, autocast lists and dropout on CPU), :mod:`~lightning_pilot.estimate.routing`
(mixture-of-experts routing), :mod:`~lightning_pilot.estimate.checkpointing`,
:mod:`~lightning_pilot.estimate.blocks` (block extrapolation) and
:mod:`~lightning_pilot.estimate.compat` (third-party patches).

Example:
    >>> import torch
    >>> from lightning_pilot.demo import TinyCausalLM, InstructionDataModule
    >>> data = InstructionDataModule(batch_size=4, max_length=32)
    >>> data.setup("fit")
    >>> batch = next(iter(data.train_dataloader()))
    >>> session = Session(TinyCausalLM(max_length=32), precision="32-true")
    >>> with session:
    ...     train = session.train_phases(batch, micro_batch=8, seq_len=32)
    >>> train["forward"].peak_bytes > 0, sorted(train)
    (True, ['backward', 'forward'])
"""

from __future__ import annotations

from lightning_pilot.estimate.batches import reshape_batch
from lightning_pilot.estimate.blocks import repeated_blocks
from lightning_pilot.estimate.checkpointing import CHECKPOINTING, selective_checkpoint_context
from lightning_pilot.estimate.cuda import (
    cuda_attention,
    cuda_autocast,
    cuda_autocast_policy,
    cuda_dropout,
)
from lightning_pilot.estimate.optimizers import (
    cuda_optimizer_defaults,
    optimizer_implementation,
    optimizer_of,
)
from lightning_pilot.estimate.precision import PRECISIONS, precision_context
from lightning_pilot.estimate.recorder import (
    CATEGORIES,
    PhaseTrace,
    Recorder,
    UntraceableError,
    causal_fraction,
)
from lightning_pilot.estimate.routing import BalancedRouting, balanced_routes
from lightning_pilot.estimate.session import Session

__all__ = [
    "CATEGORIES",
    "CHECKPOINTING",
    "PRECISIONS",
    "BalancedRouting",
    "PhaseTrace",
    "Recorder",
    "Session",
    "UntraceableError",
    "balanced_routes",
    "causal_fraction",
    "cuda_attention",
    "cuda_autocast",
    "cuda_autocast_policy",
    "cuda_dropout",
    "cuda_optimizer_defaults",
    "optimizer_implementation",
    "optimizer_of",
    "precision_context",
    "repeated_blocks",
    "reshape_batch",
    "selective_checkpoint_context",
]
