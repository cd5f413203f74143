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

import contextlib
import functools
import gc
import importlib.abc
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pilot.core import validate

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

#: The precisions of Lightning's ``Trainer(precision=...)`` the estimate models.
PRECISIONS: Final = ("32-true", "16-mixed", "bf16-mixed", "bf16-true")
#: The memory categories of a phase, in the order they are assigned (first match wins).
CATEGORIES: Final = (
    "weights",
    "gradients",
    "optimizer_state",
    "batch",
    "activations",
    "temporaries",
)
# Integer and boolean tensors larger than this carry no real copy (a B x 1 x T x T mask at
# 70B sizes would cost real memory); reading their values is then untraceable.
_SHADOW_LIMIT: Final = 1 << 24
_FLOAT_SHADOW_LIMIT: Final = 4096
_SHADOW: Final = "_lightning_pilot_shadow"
_DTYPE_KIND: Final = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}

_WORKAROUND: Final = (
    "the value depends on the model's floats, which a fake tensor does not have; move the read"
    " out of training_step/validation_step (log the tensor, not its .item()), or guard it with"
    " `if not torch.compiler.is_compiling()`-style checks the estimator cannot pass; for a"
    " value computed from the batch alone, keep it an integer/bool tensor"
)


class UntraceableError(RuntimeError):
    """A step needs a value fake tensors do not have; ``op`` names the operator."""

    def __init__(self, op: str, where: str) -> None:
        self.op = op
        super().__init__(
            f"cannot trace {op} on a fake tensor ({where}): {_WORKAROUND}",
        )


def _ops_of(name: str) -> Any:
    return getattr(torch.ops.aten, name).default


_LOCAL_SCALAR: Final = torch.ops.aten._local_scalar_dense.default
# Operators that neither allocate nor compute (device and size queries): no bookkeeping.
_PASS_THROUGH: Final = frozenset(
    {
        torch.ops.prim.device.default,
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_storage_offset.default,
        torch.ops.aten.is_same_size.default,
    }
)


def _flop_registry() -> dict[Any, Callable[..., int]]:
    """``torch.utils.flop_counter``'s registry (what ``FlopCounterMode`` counts), plus the CPU
    flash-attention kernels it lacks (same formulas as the CUDA kernels)."""
    from torch.utils import flop_counter

    registry: dict[Any, Callable[..., int]] = dict(flop_counter.flop_registry)

    def cpu_flash(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return int(flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape))  # type: ignore[no-untyped-call]

    def cpu_flash_backward(
        grad_out: Any, query: Any, key: Any, value: Any, *a: Any, **k: Any
    ) -> int:
        return int(
            flop_counter.sdpa_backward_flop_count(  # type: ignore[no-untyped-call]
                grad_out.shape, query.shape, key.shape, value.shape
            )
        )

    aten = torch.ops.aten
    registry[aten._scaled_dot_product_flash_attention_for_cpu] = cpu_flash
    registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = cpu_flash_backward
    return registry


_FLOPS: dict[Any, Callable[..., int]] | None = None

# Operators that alias their input without marking it (``func.is_view`` is false): no bytes
# move. ``aten._unsafe_view`` is what every ``F.linear`` on a 3-D input returns (the 2-D
# product reshaped back).
_ALIASES: Final = frozenset({torch.ops.aten._unsafe_view.default})

# Fused attention kernels (forward and backward) and the dimension of their query/key
# holding the sequence: with a causal mask they skip the masked blocks (FlashAttention and the
# memory-efficient kernel iterate only over the key blocks at or before each query block).
_ATTENTION_SEQ_DIM: Final = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: -2,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: -2,
    torch.ops.aten._scaled_dot_product_flash_attention: -2,
    torch.ops.aten._scaled_dot_product_flash_attention_backward: -2,
    torch.ops.aten._scaled_dot_product_efficient_attention: -2,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward: -2,
    torch.ops.aten._scaled_dot_product_cudnn_attention: -2,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward: -2,
    torch.ops.aten._flash_attention_forward: 1,
    torch.ops.aten._flash_attention_backward: 1,
    torch.ops.aten._efficient_attention_forward: 1,
    torch.ops.aten._efficient_attention_backward: 1,
}


def _argument(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], name: str) -> Any:
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if argument.kwarg_only or index >= len(args):
                return kwargs.get(name, argument.default_value)
            return args[index]
    return None


def causal_fraction(queries: int, keys: int) -> float:
    """The share of the query x key pairs a causal mask (top-left aligned, as
    ``is_causal=True``) keeps: the work a causal fused attention kernel does, against the full
    product.

    Example:
        >>> causal_fraction(4, 4), causal_fraction(2048, 2048)
        (0.625, 0.500244140625)
    """
    if queries <= 0 or keys <= 0:
        return 1.0
    if queries <= keys:
        kept = queries * (queries + 1) // 2
    else:
        kept = keys * (keys + 1) // 2 + (queries - keys) * keys
    return kept / (queries * keys)


def _causal_fraction(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> float:
    """:func:`causal_fraction` for a fused attention call with ``is_causal`` (or the
    memory-efficient kernel's ``custom_mask_type`` 1, causal from the top left); 1 else."""
    causal = _argument(func, args, kwargs, "is_causal")
    if causal is None:
        causal = _argument(func, args, kwargs, "custom_mask_type") == 1
    if not causal:
        return 1.0
    query = _argument(func, args, kwargs, "query")
    key = _argument(func, args, kwargs, "key")
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return 1.0
    dim = _ATTENTION_SEQ_DIM[func.overloadpacket]
    return causal_fraction(int(query.shape[dim]), int(key.shape[dim]))


def _tensors(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


@dataclass
class PhaseTrace:
    """One traced phase: its peak, the categories at the peak, and its operators.

    ``curve[i]`` is the live bytes after operator ``i``; ``flops``, ``moved`` (bytes read and
    written) and ``kinds`` (0 memory-bound, 1 fp32, 2 bf16, 3 fp16 arithmetic) are per operator;
    ``signature`` identifies the operator sequence (two traces with equal signatures ran the
    same operators in the same order).
    """

    phase: str
    peak_bytes: int
    categories: dict[str, int]
    curve: np.ndarray
    flops: np.ndarray
    moved: np.ndarray
    kinds: np.ndarray
    peak_op: int
    signature: int
    start_bytes: int
    segment_bytes: int = 0
    included: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: The operators' names, in order (what ``signature`` hashes).
    names: tuple[str, ...] = ()
    #: The peak's block bytes by allocator pool: small (up to 1 MiB), mid (up to 10 MiB) and
    #: large (each rounded to 2 MiB); ``segment_bytes`` rounds the first two to segments.
    segment_parts: tuple[int, int, int] = (0, 0, 0)

    def shifted(self, extra: Mapping[str, int], note: str) -> PhaseTrace:
        """The same phase with ``extra`` bytes live throughout (added to their categories)."""
        total = sum(extra.values())
        categories = dict(self.categories)
        for name, value in extra.items():
            categories[name] += value
        return PhaseTrace(
            self.phase,
            self.peak_bytes + total,
            categories,
            self.curve + total,
            self.flops,
            self.moved,
            self.kinds,
            self.peak_op,
            self.signature,
            self.start_bytes + total,
            self.segment_bytes + total,
            dict(self.included),
            [*self.notes, note],
            self.names,
            (*self.segment_parts[:2], self.segment_parts[2] + total),
        )


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Count live storage bytes, FLOPs and bytes moved per operator; keep the peak's storages.

    Enter it inside a ``FakeTensorMode`` (or on real tensors: it counts them the same way).
    ``round_to`` rounds every storage up as an allocator would (CUDA's caching allocator: 512).

    Example:
        >>> import torch
        >>> recorder = Recorder()
        >>> with recorder:
        ...     recorder.begin("demo")
        ...     x = torch.ones(1000)
        ...     y = x * 2
        ...     phase = recorder.end()
        >>> phase.peak_bytes, int(phase.flops.sum())
        (8000, 0)
    """

    def __init__(self, round_to: int = 1, *, fake_only: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.round_to = round_to
        self.fake_only = fake_only
        self.live: dict[int, tuple[int, int]] = {}
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._serial = 0
        self.current = 0
        self.peak = 0
        self._peak_op = 0
        self._snapshot: dict[int, tuple[int, int]] | None = None
        self._dirty = False
        self.saved: set[int] = set()
        self._phase = ""
        self._start = 0
        self._start_op = 0
        self._curve: list[int] = []
        self._flops: list[int] = []
        self._moved: list[int] = []
        self._kinds: list[int] = []
        self._names: list[str] = []
        self.held: set[int] = set()
        #: The routing assumption for a router's ``topk`` on fake scores (``"balanced"``), or
        #: ``None``: reading the experts' tokens is then untraceable.
        self.routing: str | None = "balanced"
        #: The busiest expert's share of the tokens over the balanced share (1: balanced).
        self.capacity_factor = 1.0
        #: ``(experts, top_k)`` of every ``topk`` routed under the assumption.
        self.routed: set[tuple[int, int]] = set()
        global _FLOPS
        if _FLOPS is None:
            _FLOPS = _flop_registry()
        self._registry = _FLOPS

    # -- storages ---------------------------------------------------------------------------

    def _size(self, nbytes: int) -> int:
        step = self.round_to
        if step <= 1 or nbytes == 0:
            return nbytes
        return max(step, -(-nbytes // step) * step)

    def record(self, tensor: torch.Tensor) -> int | None:
        """Count ``tensor``'s storage (once); return its serial number. With ``fake_only``,
        real tensors (the user's batch, the real copies of values) are not counted."""
        if self.fake_only and not isinstance(tensor, FakeTensor):
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        key = id(storage)
        known = self.live.get(key)
        if known is not None:
            return known[0]
        nbytes = self._size(int(storage.nbytes()))
        self._serial += 1
        self.live[key] = (self._serial, nbytes)
        self._refs[key] = weakref.ref(storage, self._freer(key))
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            self._peak_op = len(self._curve)
            self._dirty = True
        return self._serial

    def serial(self, tensor: torch.Tensor) -> int | None:
        """The serial number of ``tensor``'s storage, counting it if new."""
        return self.record(tensor)

    def live_serials(self) -> set[int]:
        """The serial numbers of every live storage."""
        return {serial for serial, _ in self.live.values()}

    def _freer(self, key: int) -> Callable[[Any], None]:
        recorder = weakref.ref(self)

        def free(_: Any) -> None:
            owner = recorder()
            if owner is None:
                return
            if owner._dirty:
                owner._snapshot = dict(owner.live)
                owner._dirty = False
            known = owner.live.pop(key, None)
            owner._refs.pop(key, None)
            if known is not None:
                owner.current -= known[1]

        return free

    # -- phases -----------------------------------------------------------------------------

    def begin(self, phase: str) -> None:
        """Start a phase: the peak restarts at the current level."""
        self._phase = phase
        self.peak = self.current
        self._start = self.current
        self._peak_op = 0
        self._snapshot = None
        self._dirty = True
        self._curve, self._flops, self._moved, self._kinds, self._names = [], [], [], [], []

    def peak_storages(self) -> dict[int, tuple[int, int]]:
        """``id(storage) -> (serial, bytes)`` of the storages live at the phase's peak."""
        if self._dirty or self._snapshot is None:
            self._snapshot = dict(self.live)
            self._dirty = False
        return self._snapshot

    def end(self, classes: Mapping[str, set[int]] | None = None) -> PhaseTrace:
        """End the phase: its trace, with the peak's storages sorted into ``classes``
        (category -> serial numbers; what is in none is ``temporaries``)."""
        snapshot = self.peak_storages()
        categories = dict.fromkeys(CATEGORIES, 0)
        parts = _segment_parts(nbytes for _, nbytes in snapshot.values())
        ordered = [(name, (classes or {}).get(name, set())) for name in CATEGORIES[:-1]]
        for serial, nbytes in snapshot.values():
            for name, members in ordered:
                if serial in members:
                    categories[name] += nbytes
                    break
            else:
                categories["temporaries"] += nbytes
        return PhaseTrace(
            phase=self._phase,
            peak_bytes=self.peak,
            categories=categories,
            curve=np.asarray(self._curve, dtype=np.int64),
            flops=np.asarray(self._flops, dtype=np.int64),
            moved=np.asarray(self._moved, dtype=np.int64),
            kinds=np.asarray(self._kinds, dtype=np.int8),
            peak_op=self._peak_op,
            signature=hash(names := tuple(self._names)),
            start_bytes=self._start,
            segment_bytes=segment_bytes(parts),
            names=names,
            segment_parts=parts,
        )

    # -- saved tensors ----------------------------------------------------------------------

    def saved_hooks(self) -> Any:
        """``saved_tensors_hooks`` marking what autograd saves as activations."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            serial = self.record(tensor)
            if serial is not None:
                self.saved.add(serial)
            return tensor

        def unpack(tensor: torch.Tensor) -> torch.Tensor:
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    # -- dispatch ---------------------------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if func in _PASS_THROUGH:
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if func is _LOCAL_SCALAR:
            shadow = getattr(args[0], _SHADOW, None)
            if shadow is not None:
                with unset_fake_temporarily():
                    return shadow.item()
            if not _is_fake(args[0]):
                return func(*args, **kwargs)
            raise UntraceableError(".item() (aten._local_scalar_dense)", self._where())
        try:
            if func is _GROUPED_MM and _is_fake(args[0]):
                out = _fake_grouped_mm(func, args, kwargs)
            else:
                out = func(*args, **kwargs)
            if func is _TOPK and self.routing is not None:
                self._route(args, kwargs, out)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            out = self._from_shadows(func, args, kwargs, None)
            if out is None:
                name = str(getattr(err, "func", func))
                raise UntraceableError(name, self._where()) from None
        else:
            if _all_shadowed(args, kwargs):
                self._from_shadows(func, args, kwargs, out)
            elif func._schema.is_mutable:
                _drop_written_shadows(func, args, kwargs)
        self._account(func, args, kwargs, out)
        return out

    def _route(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> None:
        """A ``topk`` over a fake floating tensor (a router's scores): the indices get real
        values under the routing assumption (:func:`balanced_routes`), so the steps that
        gather each expert's tokens (``nonzero``, ``where``, ``one_hot``, ``bincount``)
        trace."""
        indices = out[1]
        scores = args[0]
        if (
            not _is_fake(scores)
            or not scores.is_floating_point()
            or getattr(scores, _SHADOW, None) is not None
            or not _is_fake(indices)
            or indices.numel() > _SHADOW_LIMIT
        ):
            return
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        with unset_fake_temporarily():
            routes = balanced_routes(
                scores.shape, int(indices.shape[dim]), dim, self.capacity_factor
            )
        setattr(indices, _SHADOW, routes)
        self.routed.add((int(scores.shape[dim]), int(indices.shape[dim])))

    def _where(self) -> str:
        return f"phase {self._phase or 'setup'}, after {len(self._names)} operators"

    def _account(
        self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any
    ) -> None:
        inputs = _tensors(args)
        if kwargs:
            inputs.extend(v for v in tree_flatten(kwargs)[0] if isinstance(v, torch.Tensor))
        outputs = _tensors((out,))
        record = self.record
        for tensor in inputs:
            record(tensor)
        for tensor in outputs:
            record(tensor)
        flops = 0
        moved = 0
        kind = 0
        if not func.is_view and func not in _ALIASES:
            moved = sum(t.numel() * t.element_size() for t in inputs) + sum(
                t.numel() * t.element_size() for t in outputs
            )
            counter = self._registry.get(func.overloadpacket)
            if counter is not None:
                try:
                    flops = int(counter(*args, **kwargs, out_val=out))
                except Exception:  # a counter that does not know this overload: no FLOPs
                    flops = 0
                if flops and func.overloadpacket in _ATTENTION_SEQ_DIM:
                    flops = int(flops * _causal_fraction(func, args, kwargs))
                if flops and inputs:
                    kind = _DTYPE_KIND.get(inputs[0].dtype, 1)
        self._curve.append(self.current)
        self._flops.append(flops)
        self._moved.append(moved)
        self._kinds.append(kind)
        self._names.append(func.__name__)

    def _from_shadows(
        self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], fake_out: Any
    ) -> Any:
        """Run ``func`` on the real copies of its (integer/bool, batch-derived) inputs; give the
        outputs their copies. Returns the fake outputs, or ``None`` when an input has none."""
        if torch.Tag.nondeterministic_seeded in func.tags:
            return fake_out
        if fake_out is not None:
            outs = _tensors((fake_out,))
            if not outs or not _is_fake(outs[0]) or not all(map(_shadowable, outs)):
                return fake_out
        missing = False

        def real(value: Any) -> Any:
            nonlocal missing
            if isinstance(value, torch.Tensor):
                shadow = _shadow_of(value)
                if shadow is None:
                    missing = True
                return shadow
            return value

        real_args = tree_map(real, args)
        real_kwargs = tree_map(real, dict(kwargs))
        if missing:
            return None
        with unset_fake_temporarily():
            real_out = func(*real_args, **real_kwargs)
        if fake_out is None:
            mode = _fake_mode_of(args, kwargs) or torch._guards.detect_fake_mode()
            if mode is None:
                return None
            fake_out = tree_map(
                lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, real_out
            )
        for fake, shadow in zip(tree_flatten(fake_out)[0], tree_flatten(real_out)[0], strict=False):
            usable = isinstance(shadow, torch.Tensor) and _shadowable(shadow)
            if isinstance(fake, torch.Tensor) and usable:
                setattr(fake, _SHADOW, shadow)
        return fake_out


_GROUPED_MM: Final = torch.ops.aten._grouped_mm.default
_TOPK: Final = torch.ops.aten.topk.default


def _fake_grouped_mm(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """``aten._grouped_mm`` on fake tensors of any floating dtype: torch's fake kernel checks
    for bfloat16 inputs only, while the real kernels also run float32 (CUDA and CPU fall back
    to one matrix product per group). The output's shape is the bfloat16 one's, its dtype
    ``out_dtype`` or the inputs'."""
    call = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args, strict=False))
    call.update(kwargs)
    a, b = call["self"], call["mat2"]
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return func(*args, **kwargs)
    bias = call.get("bias")
    shaped = func(
        a.to(torch.bfloat16),
        b.to(torch.bfloat16),
        call.get("offs"),
        bias.to(torch.bfloat16) if bias is not None else None,
    )
    return torch.empty(shaped.shape, dtype=call.get("out_dtype") or a.dtype, device=a.device)


def balanced_routes(
    shape: Sequence[int], k: int, dim: int = -1, capacity_factor: float = 1.0
) -> torch.Tensor:
    """The expert indices of ``topk(scores, k, dim)`` for ``scores`` of ``shape`` under the
    routing assumption. Balanced (``capacity_factor=1``): row ``r`` (each token) picks the
    ``k`` distinct experts ``(r k + j) mod E`` (``E = shape[dim]``), so every expert gets
    ``tokens x k / E`` of the tokens (exactly when that divides). With ``capacity_factor``
    ``c > 1``, the first expert gets ``c`` times that share (at most every token) and the
    others share the rest evenly: the imbalance an expert capacity of ``c`` allows.

    Example:
        >>> balanced_routes((4, 4), 2).tolist()
        [[0, 1], [2, 3], [0, 1], [2, 3]]
        >>> balanced_routes((6, 4), 2).flatten().bincount().tolist()
        [3, 3, 3, 3]
        >>> balanced_routes((8, 4), 2, capacity_factor=2.0).flatten().bincount().tolist()
        [8, 3, 3, 2]
    """
    dims = len(shape)
    dim = dim % dims
    experts = int(shape[dim])
    rest = [int(n) for i, n in enumerate(shape) if i != dim]
    rows = int(np.prod(rest)) if rest else 1
    j = torch.arange(k)[None, :]
    if capacity_factor <= 1.0 or k >= experts:
        picks = (torch.arange(rows)[:, None] * k + j) % experts
    else:
        busiest = min(rows, int(np.ceil(capacity_factor * rows * k / experts)))
        first = (torch.arange(rows) < busiest).long()[:, None]
        count = k - first
        start = torch.cumsum(count, 0) - count
        other = 1 + (start + j - first) % (experts - 1)
        picks = torch.where((first == 1) & (j == 0), 0, other)
    return picks.reshape(*rest, k).movedim(-1, dim).contiguous()


class BalancedRouting(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """On real tensors, every ``topk`` over floating scores returns the indices of
    :func:`balanced_routes` (its values unchanged): the routing the estimate assumes, for a
    real run to compare with.

    Example:
        >>> import torch
        >>> with BalancedRouting():
        ...     torch.randn(4, 4).topk(2).indices.tolist()
        [[0, 1], [2, 3], [0, 1], [2, 3]]
    """

    def __init__(self, capacity_factor: float = 1.0) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.capacity_factor = capacity_factor

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _TOPK and args[0].is_floating_point():
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            k = int(out[1].shape[dim])
            routes = balanced_routes(args[0].shape, k, dim, self.capacity_factor)
            out = (out[0], routes.to(out[1].device))
        return out


_SMALL: Final = 1 << 20
_MID: Final = 10 << 20
_SEGMENT: Final = 2 << 20
_MID_SEGMENT: Final = 20 << 20


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _segment_parts(sizes: Iterator[int] | Any) -> tuple[int, int, int]:
    """Live blocks of ``sizes`` by CUDA caching allocator pool: (small, mid, large rounded)."""
    small = mid = large = 0
    for size in sizes:
        if size <= _SMALL:
            small += size
        elif size <= _MID:
            mid += size
        else:
            large += _round_up(size, _SEGMENT)
    return small, mid, large


def segment_bytes(parts: tuple[int, int, int]) -> int:
    """Bytes CUDA's caching allocator reserves for live blocks of ``parts`` (see
    :func:`_segment_parts`): blocks up to 1 MiB share 2 MiB segments, blocks up to 10 MiB
    share 20 MiB segments, larger blocks get their size rounded up to 2 MiB (PyTorch's
    CUDACachingAllocator)."""
    small, mid, large = parts
    return _round_up(small, _SEGMENT) + _round_up(mid, _MID_SEGMENT) + large


def _shadowable(tensor: torch.Tensor) -> bool:
    """Integer and boolean tensors up to :data:`_SHADOW_LIMIT` elements, small floating ones
    (optimizer step counters, scalars made from constants) up to :data:`_FLOAT_SHADOW_LIMIT`."""
    if tensor.dtype.is_complex:
        return False
    limit = _FLOAT_SHADOW_LIMIT if tensor.dtype.is_floating_point else _SHADOW_LIMIT
    return tensor.numel() <= limit


def _is_fake(value: Any) -> bool:
    return isinstance(value, FakeTensor)


def _fake_mode_of(args: Any, kwargs: Any) -> FakeTensorMode | None:
    for value in tree_flatten((args, kwargs))[0]:
        mode = getattr(value, "fake_mode", None)
        if isinstance(mode, FakeTensorMode):
            return mode
    return None


def _all_shadowed(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether every tensor input carries a real copy (true for factory operators)."""
    for value in args:
        if isinstance(value, torch.Tensor):
            if _shadow_of(value) is None:
                return False
        elif isinstance(value, list | tuple):
            for item in value:
                if isinstance(item, torch.Tensor) and _shadow_of(item) is None:
                    return False
    for value in tree_flatten(dict(kwargs))[0] if kwargs else ():
        if isinstance(value, torch.Tensor) and _shadow_of(value) is None:
            return False
    return True


def _shadow_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The real values of ``tensor``: its shadow, or itself when it is a real tensor."""
    shadow = getattr(tensor, _SHADOW, None)
    if shadow is None and not _is_fake(tensor):
        return tensor
    return shadow


def _drop_written_shadows(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """An in-place operator with an input lacking a real copy: its outputs' copies are stale."""
    for index, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        for tensor in _tensors((value,)):
            if hasattr(tensor, _SHADOW):
                delattr(tensor, _SHADOW)


# -- precision -------------------------------------------------------------------------------


def param_dtype(precision: str) -> torch.dtype:
    """The dtype of the parameters under ``precision`` (``bf16-true``: bfloat16)."""
    return torch.bfloat16 if precision == "bf16-true" else torch.float32


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matrix products run in under ``precision``."""
    return {"32-true": torch.float32, "16-mixed": torch.float16}.get(precision, torch.bfloat16)


@contextlib.contextmanager
def precision_context(precision: str) -> Iterator[None]:
    """What Lightning's precision plugin wraps around a step, on CPU: autocast for the mixed
    precisions (``torch.autocast("cpu", ...)``; inside :func:`cuda_autocast`, with CUDA
    autocast's lists), the default dtype for ``bf16-true``."""
    if precision in ("16-mixed", "bf16-mixed"):
        with torch.autocast("cpu", dtype=compute_dtype(precision)):
            yield
    elif precision == "bf16-true":
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)
    else:
        yield


# -- batches ---------------------------------------------------------------------------------


def _sequence_length(batch: Any) -> int | None:
    for value in tree_flatten(batch)[0]:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_floating_point():
            return int(value.shape[1])
    return None


def _resize(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    have = tensor.shape[dim]
    if have == 0:
        raise ValueError(f"a batch tensor of shape {tuple(tensor.shape)} is empty along {dim}")
    if size > have:
        repeats = [1] * tensor.dim()
        repeats[dim] = -(-size // have)
        tensor = tensor.repeat(*repeats)
    return tensor.narrow(dim, 0, size).contiguous()


def reshape_batch(batch: Any, micro_batch: int, seq_len: int | None = None) -> Any:
    """``batch`` (tensors in dicts, lists, tuples) with ``micro_batch`` rows and, when
    ``seq_len`` is given, ``seq_len`` positions: rows and positions are repeated or cut. The
    sequence dimension is dimension 1 of every tensor whose dimension 1 has the length of the
    first integer tensor of 2 or more dimensions (the token ids).

    Example:
        >>> import torch
        >>> batch = {"input_ids": torch.arange(6).reshape(2, 3), "ids": torch.tensor([7, 8])}
        >>> out = reshape_batch(batch, 3, 5)
        >>> out["input_ids"].tolist(), out["ids"].tolist()
        ([[0, 1, 2, 0, 1], [3, 4, 5, 3, 4], [0, 1, 2, 0, 1]], [7, 8, 7])
    """
    length = _sequence_length(batch)
    if seq_len is not None and length is None:
        raise ValueError(
            f"reshape_batch(seq_len={seq_len!r}) is invalid: expected None for a batch without"
            " an integer tensor of 2 or more dimensions (token ids)."
        )

    def fit(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        value = _resize(value.detach(), 0, micro_batch)
        if seq_len is not None and value.dim() >= 2 and value.shape[1] == length:
            value = _resize(value, 1, seq_len)
        return value

    return tree_map(fit, batch)


def _fake_batch(batch: Any, mode: FakeTensorMode, precision: str) -> Any:
    """Fake copies of a real batch; integer and boolean tensors keep their real values."""

    def convert(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_floating_point() and precision == "bf16-true":
            value = value.to(torch.bfloat16)
        fake = mode.from_tensor(value)
        if not value.is_floating_point() and value.numel() <= _SHADOW_LIMIT:
            setattr(fake, _SHADOW, value)
        return fake

    return tree_map(convert, batch)


# -- the module ------------------------------------------------------------------------------


def optimizer_of(configured: Any) -> torch.optim.Optimizer:
    """The optimizer in what ``configure_optimizers`` returned (every form Lightning takes);
    ``ValueError`` when there is none or more than one (manual optimization)."""
    found: list[torch.optim.Optimizer] = []

    def walk(value: Any) -> None:
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
        elif isinstance(value, Mapping):
            walk(value.get("optimizer"))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(configured)
    if len(found) != 1:
        raise ValueError(
            f"configure_optimizers() returned {len(found)} optimizers: the estimate models"
            " automatic optimization with exactly one optimizer"
        )
    return found[0]


def cuda_optimizer_defaults(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` with PyTorch's CUDA default applied where the user left it unset: the
    ``foreach`` implementation (``torch.optim``'s ``_default_to_fused_or_foreach`` picks it for
    CUDA tensors; on CPU it picks the for-loop).

    Example:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
        >>> cuda_optimizer_defaults(opt).param_groups[0]["foreach"]
        True
    """
    for group in optimizer.param_groups:
        if group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True
    return optimizer


def optimizer_implementation(optimizer: torch.optim.Optimizer) -> str:
    """``"fused"``, ``"foreach"`` or ``"for-loop"``: how ``optimizer.step()`` runs as its
    groups are set now (an unset ``foreach`` is the for-loop on CPU tensors; see
    :func:`cuda_optimizer_defaults` for CUDA's default); ``"single"`` for an optimizer with
    neither option; groups that differ are joined with ``"+"``.

    Example:
        >>> import torch
        >>> params = [torch.nn.Parameter(torch.ones(2))]
        >>> optimizer_implementation(torch.optim.AdamW(params, fused=True))
        'fused'
        >>> optimizer_implementation(cuda_optimizer_defaults(torch.optim.AdamW(params)))
        'foreach'
    """
    found: list[str] = []
    for group in optimizer.param_groups:
        if group.get("fused"):
            kind = "fused"
        elif group.get("foreach"):
            kind = "foreach"
        elif "foreach" in group or "foreach" in optimizer.defaults:
            kind = "for-loop"
        else:
            kind = "single"
        if kind not in found:
            found.append(kind)
    return "+".join(found) or "single"


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, torch.Tensor) else None
    return None


def _hf_models(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost Hugging Face models inside ``module`` that support checkpointing."""
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside:
            continue
        if getattr(sub, "supports_gradient_checkpointing", False) and hasattr(
            sub, "gradient_checkpointing_enable"
        ):
            found.append(sub)
            inside.update(id(m) for m in sub.modules())
    return found


#: The activation checkpointing choices: off, every block's activations recomputed, or
#: per-operator selective checkpointing (:func:`selective_checkpoint_context`).
CHECKPOINTING: Final = (False, True, "selective")


def _saved_by_selective() -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(
        {
            aten.mm.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten.max.default,
        }
    )


def selective_checkpoint_context() -> Any:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for per-operator selective
    activation checkpointing as torchtitan's ``op`` mode does it
    (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of matrix
    products (``aten.mm``, every other one: odd ones saved, even ones recomputed), of fused
    attention (flash, memory-efficient, cuDNN and the CPU stand-in :func:`cuda_attention`
    uses) and of ``aten.max`` are saved; everything else is recomputed in the backward pass.

    Example:
        >>> import torch
        >>> from torch.utils.checkpoint import checkpoint
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> y = checkpoint(
        ...     lambda t: (t @ t).relu() @ t,
        ...     x,
        ...     use_reentrant=False,
        ...     context_fn=selective_checkpoint_context,
        ... )
        >>> y.shape
        torch.Size([4, 4])
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_by_selective()
    counts = {"forward": 0, "recompute": 0}
    mm = torch.ops.aten.mm.default

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func is mm:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in saved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]


def _checkpointing_choice(owner: str, value: Any) -> bool | str:
    if isinstance(value, bool) or (isinstance(value, str) and value == "selective"):
        return value
    raise ValueError(validate.invalid(owner, "checkpointing", value, "False, True or 'selective'"))


@contextlib.contextmanager
def activation_checkpointing(
    module: torch.nn.Module,
    classes: tuple[type[torch.nn.Module], ...],
    selective: bool = False,
) -> Iterator[str]:
    """Activation checkpointing on ``module`` for the duration, then exactly what was there.

    ``classes`` given: every instance's ``forward`` runs under ``torch.utils.checkpoint``
    (non-reentrant). Else the Hugging Face models inside are switched with their own
    ``gradient_checkpointing_enable`` (non-reentrant) and switched back. ``selective``:
    per-operator selective checkpointing inside each (:func:`selective_checkpoint_context`).
    Yields how.
    """
    undo: list[Callable[[], None]] = []
    try:
        if classes:
            how = "torch.utils.checkpoint around " + ", ".join(c.__name__ for c in classes)
            for sub in module.modules():
                if isinstance(sub, classes):
                    undo.append(_wrap_forward(sub, selective))
            if not undo:
                raise ValueError(f"no submodule is an instance of {[c.__name__ for c in classes]}")
        else:
            models = _hf_models(module)
            if not models:
                raise ValueError(
                    "activation checkpointing needs checkpoint_classes (the module classes to"
                    " wrap) for a module without a Hugging Face model inside: pass"
                    " estimate(checkpoint_classes=[YourBlock]) (TargetEstimator: the same"
                    " argument; the CLI: --checkpoint-class package.module:YourBlock)"
                )
            how = "Hugging Face gradient_checkpointing_enable(use_reentrant=False)"
            for model in models:
                if _hf_checkpointing(model):
                    continue
                restore = _hf_disable(model)
                undo.append(restore)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _hf_call(model, "enable", selective)
        if selective:
            how += (
                ", selective per operator (matrix products, every other one, and attention"
                " saved; the rest recomputed)"
            )
        yield how
    finally:
        for step in reversed(undo):
            step()


_HOOK_DICTS: Final = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def _hf_checkpointing(model: torch.nn.Module) -> bool:
    """Whether a Hugging Face model has activation checkpointing on (either spelling)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _hf_call(model: Any, what: str, selective: bool = False) -> None:
    """Switch checkpointing on (non-reentrant) or off, with the newer name where it exists
    (transformers 5: ``activation_checkpointing_*``), else ``gradient_checkpointing_*``."""
    new = getattr(model, f"activation_checkpointing_{what}", None)
    old = getattr(model, f"gradient_checkpointing_{what}")
    kwargs: dict[str, Any] = {}
    if what == "enable":
        key = "activation_checkpointing_kwargs" if new else "gradient_checkpointing_kwargs"
        kwargs[key] = {"use_reentrant": False}
        if selective:
            kwargs[key]["context_fn"] = selective_checkpoint_context
    (new or old)(**kwargs)


def _hf_disable(model: torch.nn.Module) -> Callable[[], None]:
    """What switches checkpointing off again and removes what switching it on left: the
    input-gradient hook on the embeddings, new attributes, the ``use_cache`` setting."""
    kept = []
    for sub in model.modules():
        hooks = {name: set(getattr(sub, name, {})) for name in _HOOK_DICTS}
        kept.append((sub, set(vars(sub)), hooks))
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)

    def disable() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _hf_call(model, "disable")
        for sub, names, hooks in kept:
            for name in set(vars(sub)) - names:
                delattr(sub, name)
            for name, keys in hooks.items():
                table: Any = getattr(sub, name, None) or {}
                for key in set(table) - keys:
                    del table[key]
        if config is not None and use_cache is not None:
            config.use_cache = use_cache

    return disable


def _wrap_forward(sub: torch.nn.Module, selective: bool = False) -> Callable[[], None]:
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    had = "forward" in sub.__dict__
    before = sub.__dict__.get("forward")
    inner = sub.forward
    context_fn = selective_checkpoint_context if selective else noop_context_fn

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    sub.forward = forward

    def restore() -> None:
        if had:
            setattr(sub, "forward", before)  # noqa: B010
        else:
            del sub.forward

    return restore


# -- repeated blocks -------------------------------------------------------------------------

#: The block counts a block list is cut to: the first and last block of each trace may differ
#: from the others (the first layer's input is the embedding's output, its backward the last
#: before the embedding's), so three counts of 3 and more leave the middle blocks to fit.
CUTS: Final = (3, 4, 5)
#: A block list shorter than this is traced in full (the cuts cost 12 blocks).
MIN_BLOCKS: Final = 16


def _structure(module: torch.nn.Module) -> tuple[Any, ...]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (
        tuple((name, tuple(t.shape), t.dtype) for name, t in tensors),
        tuple(type(sub).__name__ for sub in module.modules()),
    )


def repeated_blocks(module: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """``(name, container)`` of the module's repeated block list: the longest
    ``nn.ModuleList`` or ``nn.Sequential`` whose children are all of one class with the same
    parameters and buffers (names, shapes, dtypes) and the same submodules (Llama's
    ``model.layers``, GPT-2's ``transformer.h``), of at least :data:`MIN_BLOCKS` children;
    ``None`` when there is none.

    Example:
        >>> from torch import nn
        >>> layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(16))
        >>> repeated_blocks(nn.Sequential(nn.Linear(4, 4), layers))[0]
        '1'
    """
    best: tuple[str, torch.nn.Module] | None = None
    for name, sub in module.named_modules():
        if not isinstance(sub, torch.nn.ModuleList | torch.nn.Sequential):
            continue
        children = list(sub._modules.values())
        if len(children) < MIN_BLOCKS or (
            best is not None and len(children) <= len(best[1]._modules)
        ):
            continue
        first = children[0]
        if first is None or any(type(c) is not type(first) for c in children):
            continue
        shape = _structure(first)
        if all(_structure(c) == shape for c in children[1:] if c is not None):
            best = (name, sub)
    return best


@contextlib.contextmanager
def cut_blocks(container: torch.nn.Module, count: int) -> Iterator[list[torch.nn.Module]]:
    """``container`` (a block list) holding only its first ``count`` blocks for the duration;
    the very same dictionary of blocks is put back after. Yields the blocks left out."""
    original = container.__dict__["_modules"]
    items = list(original.items())
    container.__dict__["_modules"] = type(original)(items[:count])
    try:
        yield [block for _, block in items[count:] if block is not None]
    finally:
        container.__dict__["_modules"] = original


def _alignment(names: Sequence[tuple[str, ...]]) -> tuple[int, list[int]] | None:
    """``(block length, candidate prefix lengths)`` when the operator names of the traces at
    :data:`CUTS` blocks may be ``prefix + block * k + suffix`` (checked by the caller)."""
    first, second = names[0], names[1]
    lengths = [len(n) for n in names]
    size = lengths[1] - lengths[0]
    if size <= 0 or lengths[2] - lengths[1] != size:
        return None
    n1, n2, k1 = lengths[0], lengths[1], CUTS[0]
    common = 0
    while common < n1 and first[common] == second[common]:
        common += 1
    tail = 0
    while tail < n1 and first[n1 - 1 - tail] == second[n2 - 1 - tail]:
        tail += 1
    low, high = max(n1 - tail, 0), min(common - k1 * size, n1 - k1 * size)
    candidates = list(range(low, high + 1))
    return (size, candidates) if candidates else None


def _affine_in_count(values: Sequence[Any], count: int) -> Any:
    """The value at ``count`` blocks from the values at :data:`CUTS` (``None`` unless the
    three are affine in the block count; arrays compared element by element)."""
    a, b, c = values
    step = CUTS[1] - CUTS[0]
    if not np.array_equal(np.asarray(c) - b, np.asarray(b) - a):
        return None
    return b + (count - CUTS[1]) // step * (b - a)


def _synthesize(
    arrays: Sequence[np.ndarray], prefix: int, size: int, count: int
) -> np.ndarray | None:
    """Per operator, the value at ``count`` blocks from the values at :data:`CUTS` blocks.
    The prefix with the first block, and the last block with the suffix, are affine in the
    block count ``k``; a middle block ``m`` (0 for the second block) is ``a + b m + c k``,
    with ``a``, ``b``, ``c`` from three of the six middle blocks traced, checked on the other
    three. ``None`` when a value breaks the pattern."""
    k2 = CUTS[1]
    heads = [a[: prefix + size] for a in arrays]
    tails = [a[prefix + (k - 1) * size :] for a, k in zip(arrays, CUTS, strict=True)]
    middles = [
        a[prefix + size : prefix + (k - 1) * size].reshape(k - 2, size)
        for a, k in zip(arrays, CUTS, strict=True)
    ]
    head = _affine_in_count(heads, count)
    tail = _affine_in_count(tails, count)
    if head is None or tail is None:
        return None
    two, three = middles[1], middles[2]
    step_m = two[1] - two[0]
    step_k = two[0] - middles[0][0]
    if not (
        np.array_equal(three[0] - two[0], step_k)
        and np.array_equal(three[1] - three[0], step_m)
        and np.array_equal(three[2] - three[1], step_m)
    ):
        return None
    m = np.arange(count - 2, dtype=np.int64)[:, None]
    body = two[0][None, :] + m * step_m[None, :] + (count - k2) * step_k[None, :]
    return np.concatenate([head, body.reshape(-1).astype(arrays[0].dtype), tail])


def extrapolate_blocks(
    traces: Sequence[PhaseTrace], count: int
) -> tuple[PhaseTrace | None, str | None]:
    """The phase of the whole module (``count`` blocks) from its traces with the block list
    cut to :data:`CUTS` blocks: ``(trace, None)``, or ``(None, why)`` when the three traces do
    not follow ``prefix + block x k + suffix`` with every operator's live bytes, FLOPs and
    bytes moved, and the peak's categories and allocator pools, affine in the block count
    (checked exactly on the three; see :func:`_synthesize`). The operators' sequence, their
    FLOPs and bytes moved, the live bytes after each, the peak and its categories are then
    those a full trace gives (``tests/estimate/test_blocks.py`` compares them exactly)."""
    names = [t.names for t in traces]
    aligned = _alignment(names)
    cuts = ", ".join(map(str, CUTS))
    if aligned is None:
        return None, f"the traces at {cuts} blocks do not repeat one block of operators"
    size, candidates = aligned
    if any(t.peak_bytes != max(t.start_bytes, int(t.curve.max(initial=0))) for t in traces):
        return None, "a traced peak falls between operators"
    if any(t.included != traces[0].included for t in traces):
        return None, f"the traces at {cuts} blocks hold different state"
    start = _affine_in_count([t.start_bytes for t in traces], count)
    categories = {
        name: _affine_in_count([t.categories[name] for t in traces], count) for name in CATEGORIES
    }
    parts = [_affine_in_count([t.segment_parts[i] for t in traces], count) for i in range(3)]
    if start is None or None in categories.values() or None in parts:
        return None, "the peak's categories are not affine in the block count"
    for prefix in candidates:
        head, block = names[0][:prefix], names[0][prefix : prefix + size]
        tail = names[0][prefix + CUTS[0] * size :]
        if any(n != head + block * k + tail for n, k in zip(names, CUTS, strict=True)):
            continue
        made = [
            _synthesize([t.curve for t in traces], prefix, size, count),
            _synthesize([t.flops for t in traces], prefix, size, count),
            _synthesize([t.moved for t in traces], prefix, size, count),
            _synthesize([t.kinds for t in traces], prefix, size, count),
        ]
        if any(m is None for m in made):
            continue
        curve, flops, moved, kinds = (m for m in made if m is not None)
        peak = max(start, int(curve.max(initial=0)))
        if sum(v or 0 for v in categories.values()) != peak:
            continue
        order = head + block * count + tail
        return PhaseTrace(
            phase=traces[0].phase,
            peak_bytes=peak,
            categories={k: int(v or 0) for k, v in categories.items()},
            curve=curve,
            flops=flops,
            moved=moved,
            kinds=kinds,
            peak_op=int(np.argmax(curve)) if len(curve) else 0,
            signature=hash(order),
            start_bytes=start,
            segment_bytes=segment_bytes((parts[0] or 0, parts[1] or 0, parts[2] or 0)),
            included=dict(traces[0].included),
            notes=list(traces[0].notes),
            names=order,
            segment_parts=(parts[0] or 0, parts[1] or 0, parts[2] or 0),
        ), None
    return None, "an operator's live bytes, FLOPs or bytes moved are not affine in the block count"


class Session:
    """The user's module on fake tensors, with its optimizer, for one precision.

    ``module`` is a live LightningModule (its parameters and buffers are replaced by fake ones
    for the session and given back, with its training flags, when it ends) or ``factory``, a
    callable building one (called under the fake mode: a 70B shape never allocates). Use it as
    a context manager; trace phases inside. ``round_to`` is the allocator's rounding (512 for
    CUDA). ``cuda=True`` makes the step behave as on CUDA: the optimizer's ``foreach``
    implementation where the user left it unset (PyTorch's default there), attention
    (``scaled_dot_product_attention``) through a fused kernel that saves no T x T matrix
    (CUDA's flash and memory-efficient kernels; see :func:`cuda_attention`), CUDA autocast's
    lists under the mixed precisions (:func:`cuda_autocast`: softmax, layer_norm, the losses
    ... in float32) and CUDA's fused dropout (:func:`cuda_dropout`: a one-byte mask saved).
    ``blocks=True`` (the default): with a repeated block list (:func:`repeated_blocks`: Llama's
    ``model.layers``, GPT-2's ``transformer.h``, at least :data:`MIN_BLOCKS` blocks), the
    phases that run the batch (``train_phases``, ``validation_phase``) trace the list cut to
    :data:`CUTS` blocks and extrapolate to all (:func:`extrapolate_blocks`), falling back to a
    full trace, with a note, when the pattern does not hold.

    Example:
        >>> from lightning_pilot.demo import TinyCausalLM
        >>> model = TinyCausalLM(max_length=32)
        >>> before = model.token_embedding.weight
        >>> with Session(model, precision="bf16-true") as session:
        ...     session.module.token_embedding.weight.dtype
        torch.bfloat16
        >>> model.token_embedding.weight is before
        True
    """

    def __init__(
        self,
        module: Any = None,
        *,
        factory: Callable[[], Any] | None = None,
        precision: str = "32-true",
        round_to: int = 1,
        cuda: bool = False,
        checkpoint_classes: Sequence[type[torch.nn.Module]] = (),
        blocks: bool = True,
        capacity_factor: float = 1.0,
    ) -> None:
        owner = "Session"
        if (module is None) == (factory is None):
            raise ValueError(
                validate.invalid(owner, "module", module, "a LightningModule, or None with factory")
            )
        if module is not None:
            validate.instance(owner, "module", module, torch.nn.Module, optional=False)
        validate.callable_or_none(owner, "factory", factory, "factory() -> LightningModule")
        self.precision = validate.choice(owner, "precision", precision, PRECISIONS)
        self.round_to = validate.integer(owner, "round_to", round_to, minimum=1)
        self.cuda = validate.boolean(owner, "cuda", cuda)
        self.checkpoint_classes = tuple(checkpoint_classes)
        self.by_blocks = validate.boolean(owner, "blocks", blocks)
        #: ``(name, container)`` of the repeated block list the phases are cut to, or ``None``.
        self.blocks: tuple[str, torch.nn.Module] | None = None
        self._hidden: list[torch.nn.Module] = []
        self._live = module
        self._factory = factory
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.recorder = Recorder(round_to, fake_only=True)
        self.recorder.capacity_factor = validate.number(
            owner, "capacity_factor", capacity_factor, minimum=1.0
        )
        self.module: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._restore: list[Callable[[], None]] = []
        self._stack = contextlib.ExitStack()
        self.state: dict[str, int] = {}
        self._warm: set[tuple[int | None, int | None]] = set()
        self._cut: tuple[Any, int] | None = None
        # (phase kind, checkpointing) -> why cutting failed for it: traced in full after.
        self._uncut: dict[tuple[Any, ...], str] = {}
        #: The optimizer's implementation, for the notes of the optimizer phases.
        self.optimizer_note = ""

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Session:
        stack = self._stack
        stack.__enter__()
        try:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            stack.enter_context(self.mode)
            stack.enter_context(self.recorder)
            stack.enter_context(_transformers_sees_real_values())
            if self.cuda:
                stack.enter_context(cuda_attention())
                stack.enter_context(cuda_autocast())
                stack.enter_context(cuda_dropout())
            stack.callback(self._give_back)
            if self._factory is not None:
                self.module = self._factory()
            else:
                self.module = self._live
                self._restore.append(_keeper(self.module))
            self._fake_parameters()
            # What exists now lives through the session: later collections skip it (fast).
            gc.freeze()
            stack.callback(gc.unfreeze)
            if self.by_blocks:
                self.blocks = repeated_blocks(self.module)
        except BaseException:
            stack.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.optimizer = None
        self._stack.__exit__(*exc)

    def _give_back(self) -> None:
        for step in reversed(self._restore):
            step()
        self._restore.clear()

    def _fake_parameters(self) -> None:
        """Replace every parameter and buffer by a fake one of the precision's dtype."""
        dtype = param_dtype(self.precision)
        made: dict[int, torch.Tensor] = {}
        recorder = self.recorder
        for sub in self.module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, value in list(table.items()):
                    if value is None:
                        continue
                    if _is_fake(value) and (value.dtype == dtype or not value.is_floating_point()):
                        continue  # built by the factory under the fake mode: already fake
                    is_param = table is sub._parameters
                    table[name] = self._fake_like(value, dtype, made, is_param)
                    if not _is_fake(value):  # the live module's own tensor: given back
                        self._restore.append(_putter(table, name, value))
        for value in made.values():
            recorder.record(value)
        for value in [*self.module.parameters(), *self.module.buffers()]:
            recorder.record(value)

    def _fake_like(
        self, value: torch.Tensor, dtype: torch.dtype, made: dict[int, torch.Tensor], param: bool
    ) -> torch.Tensor:
        fake = made.get(id(value))
        if fake is not None:
            return fake
        want = dtype if value.is_floating_point() else value.dtype
        fake = torch.empty(value.shape, dtype=want, device="cpu")
        if not param:
            # Buffers keep their values where the step may read them (position ids, token
            # type ids, step counters): integer and small tensors get a real copy.
            shadow = _shadow_of(value) if _is_fake(value) else value.detach().to("cpu", want)
            if shadow is not None and _shadowable(shadow):
                with unset_fake_temporarily():
                    setattr(fake, _SHADOW, shadow.clone())
        if param:
            fake = torch.nn.Parameter(fake, requires_grad=value.requires_grad)
        made[id(value)] = fake
        return fake

    # -- classes ----------------------------------------------------------------------------

    def _serials(self, tensors: Any) -> set[int]:
        serials: set[int] = set()
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                serial = self.recorder.serial(tensor)
                if serial is not None:
                    serials.add(serial)
        return serials

    def _state_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        module = self.module
        weights = [*module.parameters(), *module.buffers()]
        for block in self._hidden:  # left out of a cut block list: still on the device
            weights.extend([*block.parameters(), *block.buffers()])
        grads = [p.grad for p in self._parameters() if p.grad is not None]
        state: list[torch.Tensor] = []
        if self.optimizer is not None:
            for per_param in self.optimizer.state.values():
                state.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
        return weights, grads, state

    def _classes(self, batch: Any, extra: Mapping[str, set[int]]) -> dict[str, set[int]]:
        weights, grads, state = self._state_tensors()
        classes = {
            "weights": self._serials(weights),
            "gradients": self._serials(grads) | extra.get("gradients", set()),
            "optimizer_state": self._serials(state) | extra.get("optimizer_state", set()),
            "batch": self._serials(tree_flatten(batch)[0]),
            "activations": self.recorder.saved | self.recorder.held,
        }
        return classes

    def measure_state(self) -> dict[str, int]:
        """Bytes of weights (parameters and buffers), gradients and optimizer state now live."""
        weights, grads, state = self._state_tensors()
        live = self.recorder.live

        def total(tensors: list[torch.Tensor]) -> int:
            seen: dict[int, int] = {}
            for tensor in tensors:
                self.recorder.record(tensor)
                key = id(tensor.untyped_storage())
                seen[key] = live[key][1]
            return sum(seen.values())

        return {
            "weights": total(weights),
            "gradients": total(grads),
            "optimizer_state": total(state),
        }

    # -- phases -----------------------------------------------------------------------------

    def _parameters(self) -> list[torch.nn.Parameter]:
        """The module's parameters, those of the blocks a cut leaves out included."""
        params = list(self.module.parameters())
        for block in self._hidden:
            params.extend(block.parameters())
        return params

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        for param in self._parameters():
            param.grad = None

    def _mirror_gradients(self, container: torch.nn.Module, kept: int) -> None:
        """After a backward pass through the first ``kept`` blocks: the other blocks get the
        gradients the first one got (as a backward pass through all of them leaves)."""
        blocks = [b for b in container._modules.values() if b is not None]
        first = list(blocks[0].parameters())
        for block in blocks[kept:]:
            for model, param in zip(first, block.parameters(), strict=True):
                if model.grad is not None and param.grad is None:
                    param.grad = torch.empty_like(param)

    def _batch(self, batch: Any, micro_batch: int, seq_len: int | None) -> Any:
        with unset_fake_temporarily():
            real = reshape_batch(batch, micro_batch, seq_len)
        fake = _fake_batch(real, self.mode, self.precision)
        for tensor in tree_flatten(fake)[0]:
            if isinstance(tensor, torch.Tensor):
                self.recorder.record(tensor)
        return fake

    def _run(self, run: Callable[[], dict[str, PhaseTrace]]) -> dict[str, PhaseTrace]:
        """``run()`` with Python's cyclic garbage collected first and none collected during:
        a storage is then freed exactly when its last reference goes, never at the moment a
        collection happens to run (which would make two traces of the same step differ)."""
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        self.recorder.routed = set()
        try:
            traced = run()
        finally:
            if enabled:
                gc.enable()
        note = self.routing_note()
        if note:
            for trace in traced.values():
                trace.notes.append(note)
        return traced

    def routing_note(self) -> str | None:
        """What the last trace assumed of a router (a ``topk`` over the model's floats):
        ``None`` when nothing was routed."""
        routed = sorted(self.recorder.routed)
        if not routed:
            return None
        which = ", ".join(f"top-{k} of {e} experts" for e, k in routed)
        factor = self.recorder.capacity_factor
        if factor > 1.0:
            how = (
                f"the busiest expert given {factor:g} x the balanced share (tokens x top-k /"
                " experts), the others the rest evenly"
            )
        else:
            how = "balanced: each expert given tokens x top-k / experts of the tokens"
        return (
            f"routing: assumed, {how} ({which}); the router's real choice depends on the"
            " model's floats"
        )

    def _by_blocks(
        self, run: Callable[[], dict[str, PhaseTrace]], key: Any, *, train: bool = False
    ) -> dict[str, PhaseTrace]:
        """``run()`` on the whole module, or, with a repeated block list, on the list cut to 1,
        2 and 3 blocks, extrapolated to all (:func:`extrapolate_blocks`); traced in full, with a
        note saying why, when the cut traces do not follow the pattern or fail."""
        if self.blocks is None:
            traced = self._run(run)
            if self.by_blocks:
                for trace in traced.values():
                    trace.notes.append(
                        f"blocks: traced in full (no repeated block list of {MIN_BLOCKS} or"
                        " more blocks of one class)"
                    )
            return traced
        if key[:1] + key[3:] in self._uncut:  # cut once without the pattern: trace in full
            full = self._run(run)
            for trace in full.values():
                trace.notes.append(self._uncut[key[:1] + key[3:]])
            return full
        name, container = self.blocks
        count = len(container._modules)
        kind = type(next(iter(container._modules.values()))).__name__
        cut: list[dict[str, PhaseTrace]] = []
        reason: str | None = None
        try:
            for k in CUTS:
                with cut_blocks(container, k) as hidden:
                    self._hidden = hidden
                    self._cut = (key, k)
                    cut.append(self._run(run))
        except UntraceableError:
            raise
        except Exception as err:  # the cut module fails where the whole may not
            reason = f"the trace cut to {len(cut) + 1} blocks failed ({type(err).__name__}: {err})"
        finally:
            self._hidden = []
            self._cut = None
        if train and len(cut) == len(CUTS):
            self._mirror_gradients(container, CUTS[-1])
        made: dict[str, PhaseTrace] = {}
        if reason is None:
            for phase in cut[0]:
                extrapolated, reason = extrapolate_blocks([c[phase] for c in cut], count)
                if extrapolated is None:
                    break
                made[phase] = extrapolated
        if reason is None:
            note = (
                f"blocks: traced with {name} cut to {', '.join(map(str, CUTS))} of its {count}"
                f" {kind} blocks;"
                " every operator's live bytes, FLOPs and bytes moved extrapolated to"
                f" {count} (affine in the block count, checked on the three)"
            )
            for trace in made.values():
                trace.notes.append(note)
            return made
        note = f"blocks: traced in full ({count} blocks of {name}): {reason}"
        self._uncut[key[:1] + key[3:]] = note
        full = self._run(run)
        for trace in full.values():
            trace.notes.append(note)
        return full

    def train_phases(
        self,
        batch: Any,
        *,
        micro_batch: int,
        seq_len: int | None = None,
        checkpointing: bool | str = False,
    ) -> dict[str, PhaseTrace]:
        """Trace ``forward`` (``training_step``, loss included) and ``backward`` of one
        micro-batch, from no gradients (as the first update; later updates add the gradients
        and the optimizer state, live throughout). With a repeated block list (and
        ``blocks=True``), traced on the list cut to :data:`CUTS` blocks and extrapolated.
        ``checkpointing``: one of :data:`CHECKPOINTING` (``"selective"``: per operator, see
        :func:`selective_checkpoint_context`)."""
        checkpointing = _checkpointing_choice("Session.train_phases", checkpointing)
        return self._by_blocks(
            lambda: self._train_traced(batch, micro_batch, seq_len, checkpointing),
            ("train", micro_batch, seq_len, checkpointing),
            train=True,
        )

    def _train_traced(
        self, batch: Any, micro_batch: int, seq_len: int | None, checkpointing: bool | str
    ) -> dict[str, PhaseTrace]:
        recorder = self.recorder
        module = self.module
        if not getattr(module, "automatic_optimization", True):
            raise ValueError(
                "the module uses manual optimization (automatic_optimization=False): the"
                " estimate runs training_step, backward and the optimizer step itself"
            )
        self._zero_grad()
        # What of a later update's state is already live (the optimizer state, once built).
        included = {"gradients": 0, "optimizer_state": self.measure_state()["optimizer_state"]}
        fake = self._batch(batch, micro_batch, seq_len)
        module.train()
        before = _cached_attributes(module)
        traces: dict[str, PhaseTrace] = {}
        with contextlib.ExitStack() as stack:
            if checkpointing:
                stack.enter_context(
                    activation_checkpointing(
                        module, self.checkpoint_classes, checkpointing == "selective"
                    )
                )
            recorder.saved = set()
            recorder.held = set()
            recorder.begin("forward")
            with recorder.saved_hooks(), precision_context(self.precision):
                output = module.training_step(fake, 0)
            loss = _loss_of(output)
            if loss is None:
                raise ValueError(
                    "training_step returned no loss (a tensor, or a dict with 'loss'): nothing"
                    " to back-propagate"
                )
            recorder.held = recorder.live_serials() - self._serials(
                [*self._state_tensors()[0], *tree_flatten(fake)[0]]
            )
            traces["forward"] = recorder.end(self._classes(fake, {}))
            del output
            recorder.begin("backward")
            with recorder.saved_hooks():
                loss.backward()  # type: ignore[no-untyped-call]
            del loss
            traces["backward"] = recorder.end(self._classes(fake, {}))
        recorder.saved = set()
        recorder.held = set()
        del fake
        warm = (seq_len, self._cut[1] if self._cut else None)
        if _cached_attributes(module) != before and warm not in self._warm:
            # The first forward pass built a cache on the module (a mask, a positional
            # table) a later update reuses: trace again, as a later update does.
            self._warm.add(warm)
            return self._train_traced(batch, micro_batch, seq_len, checkpointing)
        self._warm.add(warm)
        for trace in traces.values():
            trace.included = dict(included)
        return traces

    def build_optimizer(self) -> torch.optim.Optimizer:
        """Call the module's ``configure_optimizers`` (CUDA's ``foreach`` default applied when
        ``cuda``)."""
        optimizer = optimizer_of(self.module.configure_optimizers())
        asked = optimizer_implementation(optimizer)
        if self.cuda:
            cuda_optimizer_defaults(optimizer)
        self.optimizer = optimizer
        used = optimizer_implementation(optimizer)
        self.optimizer_note = f"optimizer: {type(optimizer).__name__}, {used} implementation"
        if used == asked:
            self.optimizer_note += " (as configure_optimizers asked)"
        else:
            self.optimizer_note += " (PyTorch's default on CUDA; left unset by the module)"
        self.optimizer_note += {
            "foreach": ": temporaries for a whole parameter group at once",
            "fused": ": one kernel per group, no temporaries",
            "for-loop": ": one parameter's temporaries at a time",
        }.get(used, "")
        return optimizer

    def optimizer_phases(self) -> dict[str, PhaseTrace]:
        """Trace the first optimizer step (state allocated) and a later one, with gradients
        of every trainable parameter live (as after a backward pass)."""
        module = self.module
        if self.optimizer is None:
            self.build_optimizer()
        assert self.optimizer is not None
        for param in module.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.empty_like(param)
        traces: dict[str, PhaseTrace] = {}
        for phase in ("optimizer_step_first", "optimizer_step"):
            self.recorder.begin(phase)
            with precision_context("32-true"):
                self.optimizer.step()
            traces[phase] = self.recorder.end(self._classes((), {}))
            traces[phase].notes.append(self.optimizer_note)
        return traces

    def validation_phase(
        self, batch: Any, *, micro_batch: int, seq_len: int | None = None
    ) -> PhaseTrace:
        """Trace ``validation_step`` in eval mode under ``torch.no_grad()`` (cut to blocks as
        :meth:`train_phases`)."""
        traced = self._by_blocks(
            lambda: {"validation": self._validation_traced(batch, micro_batch, seq_len)},
            ("validation", micro_batch, seq_len),
        )
        return traced["validation"]

    def _validation_traced(self, batch: Any, micro_batch: int, seq_len: int | None) -> PhaseTrace:
        module = self.module
        fake = self._batch(batch, micro_batch, seq_len)
        module.eval()
        try:
            self.recorder.begin("validation")
            with torch.no_grad(), precision_context(self.precision):
                module.validation_step(fake, 0)
            trace = self.recorder.end(self._classes(fake, {}))
        finally:
            module.train()
        return trace

    def save_phase(self) -> PhaseTrace:
        """Trace the state dicts a checkpoint holds (model and optimizer). Serializing them
        copies each storage to host memory one at a time on CUDA: no device memory."""
        self.recorder.begin("checkpoint_save")
        state = {"state_dict": self.module.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        trace = self.recorder.end(self._classes((), {}))
        del state
        trace.notes.append(
            "checkpoint_save: state_dict() traced; torch.save copies storages to host memory"
            " one at a time (no device memory), modelled, not traced"
        )
        return trace


def _cached_attributes(module: torch.nn.Module) -> dict[tuple[int, str], int]:
    """``(submodule, name) -> id(value)`` of the tensor attributes (not parameters or
    buffers) of every submodule: what a forward pass that caches a tensor changes."""
    found: dict[tuple[int, str], int] = {}
    for sub in module.modules():
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                found[(id(sub), name)] = id(value)
    return found


def _keeper(module: torch.nn.Module) -> Callable[[], None]:
    """What gives back the training flags and the tensor (or ``None``) attributes of every
    submodule as they are now: a ``forward`` that caches a mask on ``self`` leaves no fake
    tensor behind."""
    kept = []
    for sub in module.modules():
        values = {k: v for k, v in vars(sub).items() if v is None or isinstance(v, torch.Tensor)}
        kept.append((sub, sub.training, values))

    def give_back() -> None:
        for sub, training, values in kept:
            sub.training = training
            for name, value in list(vars(sub).items()):
                if name in values:
                    if value is not values[name]:
                        setattr(sub, name, values[name])
                elif _is_fake(value):
                    delattr(sub, name)

    return give_back


_IMPORT_UTILS: Final = "transformers.utils.import_utils"


class _ImportsOutsideTheTrace(importlib.abc.MetaPathFinder):
    """A meta path finder for a session: a module imported during it (a factory importing
    ``transformers``, a step importing a helper) runs its body outside the fake mode and the
    recorder, as an import before the session would (its module-level tensors are real and
    not counted), and ``on_import(name, module)`` is called after. It lets the other finders
    find the module and wraps only that loader's ``exec_module``."""

    def __init__(self, on_import: Callable[[str, Any], None]) -> None:
        self.on_import = on_import
        self.active = True
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not self.active or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._finding.discard(fullname)
        loader = getattr(spec, "loader", None)
        execute = getattr(loader, "exec_module", None)
        if spec is None or execute is None:
            return spec
        finder = self

        def exec_module(module: Any) -> None:
            if not finder.active:
                execute(module)
                return
            with _disable_current_modes():
                execute(module)
            finder.on_import(fullname, module)

        # A loader that takes no attribute: imported as it is.
        with contextlib.suppress(AttributeError):
            loader.exec_module = exec_module  # type: ignore[union-attr]
        return spec


@contextlib.contextmanager
def _transformers_sees_real_values() -> Iterator[None]:
    """Hugging Face transformers takes another path when it sees a ``FakeTensor`` (it builds
    the causal mask a real run skips after ``attention_mask.all()``): for the session, a fake
    tensor that carries its real values is not fake to it, whether ``transformers`` was
    imported before the session or is imported during it (a factory that imports it). Every
    module imported during the session is imported as before it (see
    :class:`_ImportsOutsideTheTrace`); nothing imports ``transformers`` here."""
    patched: list[tuple[Any, Any]] = []

    def patch(utils: Any) -> None:
        original = getattr(utils, "is_fake_tensor", None)
        if original is None or any(u is utils for u, _ in patched):
            return

        def is_fake_tensor(value: Any) -> bool:
            return bool(original(value)) and getattr(value, _SHADOW, None) is None

        utils.is_fake_tensor = is_fake_tensor
        patched.append((utils, original))

    def on_import(name: str, module: Any) -> None:
        if name == _IMPORT_UTILS:
            patch(module)

    utils: Any = sys.modules.get(_IMPORT_UTILS)
    if utils is not None:
        patch(utils)
    with _disable_current_modes():  # imports what it needs now, not from the hook
        pass
    hook = _ImportsOutsideTheTrace(on_import)
    sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        hook.active = False
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        for module, original in reversed(patched):
            module.is_fake_tensor = original


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` through PyTorch's fused CPU kernel (see
    :func:`cuda_attention`)."""
    if query.dim() != 4:
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)
    if enable_gqa and key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(repeat, dim=1)
        value = value.repeat_interleave(repeat, dim=1)
    if torch.is_autocast_enabled("cpu"):
        # scaled_dot_product_attention is on autocast's lower-precision list (CPU and CUDA);
        # the kernel called directly here is not, so cast as autocast would.
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (
            t.to(dtype) if t.is_floating_point() else t for t in (query, key, value)
        )
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(
            ~attn_mask, float("-inf")
        )
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out  # type: ignore[no-any-return]


_SDPA: Final = torch.nn.functional.scaled_dot_product_attention


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """Attention as CUDA runs it, on CPU fake tensors, for the duration.

    On CUDA, ``scaled_dot_product_attention`` in training picks the flash or memory-efficient
    kernel (dropout included, applied inside the kernel): they save the inputs, the output and
    one log-sum-exp row per query, never the T x T weights. On CPU, dropout (or some masks)
    sends it to the math path, which saves several T x T matrices. Here every call of
    ``torch.nn.functional.scaled_dot_product_attention`` (the function is swapped for the
    duration and put back, so the recomputation of activation checkpointing sees it too) goes
    to PyTorch's fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``: the same
    inputs, outputs and saved tensors as the CUDA kernels); dropout's randomness is not
    modelled (no memory). Grouped-query attention repeats the key and value heads first.
    """
    functional = torch.nn.functional
    before = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = _fused_attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = before


# -- CUDA's autocast lists and dropout, on CPU ------------------------------------------------

# CUDA autocast's policy per operator (PyTorch's aten/src/ATen/autocast_mode.h, the lists
# documented under "CUDA Ops that can autocast to float16 / float32" in
# https://pytorch.org/docs/stable/amp.html). Every other operator with a CUDA autocast kernel
# in the installed torch is ``fp32``. CPU autocast's lists differ (softmax, log_softmax,
# layer_norm, exp, pow, ... stay in the lower precision there).
_CUDA_LOWER: Final = frozenset(
    {
        "_convolution",
        "_convolution.deprecated",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d.input",
        "conv_transpose3d.input",
        "convolution",
        "cudnn_convolution",
        "cudnn_convolution_transpose",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "linalg_vecdot",
        "linear",
        "addbmm",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "linalg_multi_dot",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention",
    }
)
_CUDA_SET_OPT_DTYPE: Final = frozenset(
    {
        "prod",
        "prod.dim_int",
        "softmax.int",
        "log_softmax.int",
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "linalg_matrix_norm.str_ord",
        "sum",
        "sum.dim_IntList",
    }
)
_CUDA_PROMOTE: Final = frozenset(
    {
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "vdot",
        "grid_sampler",
        "index_put",
        "tensordot",
        "scatter_add",
    }
)
# CUDA autocast refuses it (the message is CUDA autocast's own).
_CUDA_BANNED: Final = frozenset({"binary_cross_entropy"})
_BANNED_MESSAGE: Final = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast."
    " Many models use a sigmoid layer right before the binary cross entropy layer. In this"
    " case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits"
    " or torch.nn.BCEWithLogitsLoss (CUDA autocast refuses binary_cross_entropy)"
)
_LOWER_DTYPES: Final = (torch.float16, torch.bfloat16)


def _autocast_ops(key: str) -> set[str]:
    names = torch._C._dispatch_get_all_op_names()
    return {
        name[len("aten::") :]
        for name in names
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    }


def cuda_autocast_policy() -> dict[str, str]:
    """``operator -> policy`` of CUDA autocast in the installed torch, for every operator with
    an autocast kernel on CPU or CUDA: ``lower`` (cast to the autocast dtype), ``fp32``,
    ``fp32_set_opt_dtype`` (``dtype=float32`` when unset: softmax, log_softmax, sum, cumsum,
    ...), ``promote`` (the widest input type), ``banned`` (CUDA autocast refuses it) or
    ``none`` (CUDA autocast leaves it alone; CPU autocast casts it).

    Example:
        >>> policy = cuda_autocast_policy()
        >>> policy["mm"], policy["softmax.int"], policy["layer_norm"], policy["cat"]
        ('lower', 'fp32_set_opt_dtype', 'fp32', 'none')
    """
    return dict(_cuda_autocast_policy())


@functools.lru_cache(maxsize=1)
def _cuda_autocast_policy() -> tuple[tuple[str, str], ...]:
    cuda = _autocast_ops("AutocastCUDA")
    policy: dict[str, str] = {}
    for name in cuda | _autocast_ops("AutocastCPU"):
        if name not in cuda:
            policy[name] = "none"
        elif name in _CUDA_LOWER:
            policy[name] = "lower"
        elif name in _CUDA_SET_OPT_DTYPE:
            policy[name] = "fp32_set_opt_dtype"
        elif name in _CUDA_PROMOTE:
            policy[name] = "promote"
        elif name in _CUDA_BANNED:
            policy[name] = "banned"
        else:
            policy[name] = "fp32"
    return tuple(sorted(policy.items()))


_NO_AUTOCAST_CPU: Final = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _eligible(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype is not torch.float64
    )


def _cast_all(values: Any, dtype: torch.dtype) -> Any:
    def cast(value: Any) -> Any:
        return value.to(dtype) if _eligible(value) and value.dtype is not dtype else value

    return tree_map(cast, values)


def _autocast_kernel(op: Any, policy: str) -> Callable[..., Any]:
    """A CPU autocast kernel for ``op`` that casts as CUDA autocast does (``policy``), then
    runs ``op`` with autocast off for the call (as autocast's own kernels do)."""
    dtype_index = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == "banned":
            raise RuntimeError(_BANNED_MESSAGE)
        if policy == "lower":
            args, kwargs = _cast_all((args, kwargs), torch.get_autocast_dtype("cpu"))
        elif policy == "fp32":
            args, kwargs = _cast_all((args, kwargs), torch.float32)
        elif policy == "promote":
            found = [v for v in tree_flatten((args, kwargs))[0] if _eligible(v)]
            if found:
                widest = functools.reduce(torch.promote_types, (v.dtype for v in found))
                args, kwargs = _cast_all((args, kwargs), widest)
        elif policy == "fp32_set_opt_dtype" and args and _eligible(args[0]):
            if dtype_index is not None and dtype_index < len(args):
                if args[dtype_index] is None:
                    args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST_CPU):
            return op(*args, **kwargs)

    return kernel


def _op(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """CPU autocast follows CUDA autocast's lists for the duration (process-wide), then its
    own again.

    ``torch.autocast("cpu", dtype)`` then casts each operator's inputs as
    ``torch.autocast("cuda", dtype)`` would (:func:`cuda_autocast_policy`): matrix products,
    convolutions and attention in the lower precision; ``softmax``, ``log_softmax``,
    ``layer_norm``, ``exp``, ``pow``, ``rsqrt``, ``sum``, the losses and the others of CUDA's
    float32 list in float32 (their outputs, and what autograd saves of them, are float32 as on
    CUDA); the operators CPU autocast casts and CUDA's does not run in their inputs' types.
    The matrix products keep CPU autocast's own kernels (the same policy, and its cache of
    the parameters' casts); every other listed operator gets a kernel here, registered with
    ``torch.library`` for the ``AutocastCPU`` key and removed on exit.

    Example:
        >>> import torch
        >>> x = torch.randn(4, 4)
        >>> with cuda_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        ...     (x @ x).dtype, torch.softmax(x @ x, -1).dtype
        (torch.bfloat16, torch.float32)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     torch.softmax(x @ x, -1).dtype
        torch.bfloat16
    """
    cpu_lower = {
        name
        for name in _CUDA_LOWER
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCPU")
    }
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name, policy in cuda_autocast_policy().items():
                if name in cpu_lower:
                    continue  # CPU autocast's own kernel does the same
                library.impl(name, _autocast_kernel(_op(name), policy), "AutocastCPU")  # type: ignore[no-untyped-call]
        yield
    finally:
        library._destroy()  # type: ignore[no-untyped-call]


def _cuda_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as CUDA runs it (``aten/src/ATen/native/Dropout.cpp``): in training,
    with ``0 < p < 1`` and a non-empty input, the fused ``native_dropout`` (its backward
    keeps a boolean mask, one byte per element; ``native_functions.yaml``: ``native_dropout(Tensor
    input, float p, bool? train) -> (Tensor, Tensor)``, derivative
    ``native_dropout_backward(grad, result1, ...)``); else as on CPU."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]  # type: ignore[no-any-return]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype, device=input.device)


@contextlib.contextmanager
def cuda_dropout() -> Iterator[None]:
    """``torch.nn.functional.dropout`` (``aten::dropout``) runs CUDA's fused kernel for the
    duration (process-wide): ``native_dropout``, whose backward saves a boolean mask (one byte
    per element), where CPU's dropout saves a noise tensor of the input's dtype. Registered
    with ``torch.library`` for the ``AutogradCPU`` key and removed on exit.

    Example:
        >>> import torch
        >>> x = torch.randn(1000, requires_grad=True)
        >>> saved = []
        >>> hooks = torch.autograd.graph.saved_tensors_hooks(
        ...     lambda t: saved.append(t.dtype) or t, lambda t: t
        ... )
        >>> with cuda_dropout(), hooks:
        ...     y = torch.nn.functional.dropout(x, 0.1)
        >>> saved
        [torch.bool]
    """
    library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            library.impl("dropout", _cuda_dropout, "AutogradCPU")  # type: ignore[no-untyped-call]
        yield
    finally:
        library._destroy()  # type: ignore[no-untyped-call]


def _putter(table: dict[str, Any], name: str, value: Any) -> Callable[[], None]:
    def put() -> None:
        table[name] = value

    return put
