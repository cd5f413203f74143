"""The measurement an estimate is checked against: the same phases on REAL CPU tensors."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Sequence
from typing import Any, Final

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from lightning_pilot.core import validate
from lightning_pilot.core.memory import TensorTracker, state_tensors
from lightning_pilot.estimate.batches import reshape_batch
from lightning_pilot.estimate.checkpointing import _checkpointing_choice, activation_checkpointing
from lightning_pilot.estimate.cuda import cuda_attention, cuda_autocast, cuda_dropout
from lightning_pilot.estimate.optimizers import cuda_optimizer_defaults, optimizer_of
from lightning_pilot.estimate.precision import PRECISIONS, param_dtype, precision_context
from lightning_pilot.estimate.routing import BalancedRouting
from lightning_pilot.estimate.session import _loss_of
from lightning_pilot.vocabulary import ESTIMATE_PHASES, phase_label

#: The phases of an estimate, in campaign order (forward and backward: a later update), by
#: their :func:`~lightning_pilot.vocabulary.phase_label` (the first optimizer step:
#: ``optimizer_step_first``): :data:`~lightning_pilot.vocabulary.ESTIMATE_PHASES`.
PHASE_ORDER: Final = tuple(phase_label(phase, first) for phase, first in ESTIMATE_PHASES)


def measure_cpu(
    module: Any,
    batch: Any,
    *,
    micro_batch: int,
    seq_len: int | None = None,
    precision: str = "32-true",
    checkpointing: bool | str = False,
    checkpoint_classes: Sequence[type[torch.nn.Module]] = (),
    cuda: bool = False,
    balanced_routing: bool = False,
) -> dict[str, int]:
    """Peak live tensor bytes per phase of two real training updates as Lightning's automatic
    optimization runs them (``training_step``, ``zero_grad``, ``backward``,
    ``optimizer.step()``), then ``validation_step`` in eval mode under ``torch.no_grad()`` and
    a checkpoint save (``torch.save`` of the model and optimizer state dicts to memory), each
    measured by the pilot's CPU :class:`~lightning_pilot.core.memory.TensorTracker` (the state
    of the model included). The updates change the module: pass a fresh one.

    ``cuda=True`` runs the real CPU step with the CUDA behaviour the estimate models for a GPU
    target (``Session(cuda=True)``): CUDA autocast's lists, CUDA's fused dropout, fused
    attention and the ``foreach`` optimizer default; the same code paths, on real tensors.
    ``balanced_routing=True``: a router's ``topk`` picks experts as the estimate assumes
    (:class:`~lightning_pilot.estimate.routing.BalancedRouting`).

    Example:
        >>> from lightning_pilot.demo import TinyCausalLM, InstructionDataModule
        >>> data = InstructionDataModule(batch_size=4, max_length=32)
        >>> data.setup("fit")
        >>> batch = next(iter(data.train_dataloader()))
        >>> peaks = measure_cpu(TinyCausalLM(max_length=32), batch, micro_batch=4, seq_len=32)
        >>> sorted(peaks) == sorted(PHASE_ORDER)
        True
    """
    owner = "measure_cpu"
    validate.integer(owner, "micro_batch", micro_batch, minimum=1)
    validate.integer(owner, "seq_len", seq_len, minimum=1, optional=True)
    validate.choice(owner, "precision", precision, PRECISIONS)
    _checkpointing_choice(owner, checkpointing)
    validate.boolean(owner, "cuda", cuda)
    validate.boolean(owner, "balanced_routing", balanced_routing)
    # A copy the measurement owns: reshape_batch may hand back the caller's own tensors (a
    # batch already of the size), which the caller keeps alive through validation and save.
    data = tree_map_only(torch.Tensor, torch.clone, reshape_batch(batch, micro_batch, seq_len))
    if precision == "bf16-true":
        module = module.to(param_dtype(precision))
        data = tree_map_only(
            torch.Tensor,
            lambda v: v.to(param_dtype(precision)) if v.is_floating_point() else v,
            data,
        )
    peaks: dict[str, int] = {}
    tracker = TensorTracker()
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")
        if balanced_routing:
            stack.enter_context(BalancedRouting())
        if cuda:
            stack.enter_context(cuda_attention())
            stack.enter_context(cuda_autocast())
            stack.enter_context(cuda_dropout())
        if checkpointing:
            stack.enter_context(
                activation_checkpointing(
                    module, tuple(checkpoint_classes), checkpointing == "selective"
                )
            )
        optimizer = optimizer_of(module.configure_optimizers())
        if cuda:
            cuda_optimizer_defaults(optimizer)
        module.train()
        tracker.start()
        tracker.adopt(state_tensors(module, [optimizer]))
        tracker.adopt(t for t in tree_flatten(data)[0] if isinstance(t, torch.Tensor))
        # Lightning holds the training batch until the next one: through the optimizer step.
        for update in (1, 2):
            tracker.reset_peak()
            with precision_context(precision):
                output = module.training_step(data, 0)
            loss = _loss_of(output)
            assert loss is not None
            del output
            peaks["forward"] = tracker.peak_bytes
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_peak()
            loss.backward()  # type: ignore[no-untyped-call]
            del loss
            peaks["backward"] = tracker.peak_bytes
            tracker.reset_peak()
            optimizer.step()
            peaks[phase_label("optimizer_step", update == 1)] = tracker.peak_bytes
        # The loop lets the training batch go before validation, which brings its own.
        val_data = tree_map_only(torch.Tensor, torch.clone, data)
        del data
        module.eval()
        tracker.reset_peak()
        with torch.no_grad(), precision_context(precision):
            module.validation_step(val_data, 0)
        peaks["validation"] = tracker.peak_bytes
        del val_data
        module.train()
        tracker.reset_peak()
        buffer = io.BytesIO()
        torch.save({"state_dict": module.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        peaks["checkpoint_save"] = tracker.peak_bytes
        tracker.stop()
    return peaks
