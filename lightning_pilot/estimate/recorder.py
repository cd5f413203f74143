"""The dispatch recorder: :class:`Recorder` follows every storage the operators of a phase
touch (a :class:`~lightning_pilot.core.storage_count.StorageCounter`, the count the CPU tensor
tracker makes too) and records, per operator, the live bytes after it, its FLOPs and the bytes
it moves; :class:`PhaseTrace` is what one phase leaves (its peak, the categories at the peak,
the per-operator arrays). Also here: the FLOP registry, the causal share of fused attention and
the CUDA caching allocator's segment arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_pilot.core.storage_count import StorageCounter
from lightning_pilot.estimate.routing import _GROUPED_MM, _TOPK, _fake_grouped_mm, balanced_routes
from lightning_pilot.estimate.shadows import (
    _SHADOW,
    _SHADOW_LIMIT,
    _all_shadowed,
    _drop_written_shadows,
    _fake_mode_of,
    _inputs,
    _is_fake,
    _shadow_of,
    _shadowable,
    _tensors,
)
from lightning_pilot.vocabulary import CATEGORIES

_DTYPE_KIND: Final = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_EMPTY: Final = np.zeros(0, dtype=np.int64)

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
        super().__init__(f"cannot trace {op} on a fake tensor ({where}): {_WORKAROUND}")


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


@functools.cache
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


# Operators that are the same operation under another name: Python's ``x[:, :n]`` dispatches
# ``aten.slice`` unless it takes the whole dimension, which PyTorch dispatches as
# ``aten.alias`` (a buffer of positions sliced at the model's longest sequence). Both return a
# view: no storage, no bytes moved.
_SAME_OPERATOR: Final = {"alias.default": "slice.Tensor"}


def operator_signature(names: Sequence[str]) -> int:
    """Equal for two traces that ran the same operators in the same order, a whole-range slice
    (``aten.alias``) counted as the slice it is."""
    return hash(tuple(_SAME_OPERATOR.get(name, name) for name in names))


@dataclass
class PhaseTrace:
    """One traced phase: its peak, the categories at the peak, and its operators.

    ``curve[i]`` is the live bytes after operator ``i``; ``flops``, ``moved`` (bytes read and
    written) and ``kinds`` (0 memory-bound, 1 fp32, 2 bf16, 3 fp16 arithmetic) are per operator;
    ``signature`` identifies the operator sequence (two traces with equal signatures ran the
    same operators in the same order: :func:`operator_signature`).
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
    #: The allocations each operator makes, per operator (empty when not known): the smallest
    #: block it asks for and how many (``requests``, ``request_count``), gradients apart
    #: (``grad_requests``: their bytes); what :mod:`~lightning_pilot.estimate.cache` replays.
    requests: np.ndarray = field(default_factory=lambda: _EMPTY)
    request_count: np.ndarray = field(default_factory=lambda: _EMPTY)
    grad_requests: np.ndarray = field(default_factory=lambda: _EMPTY)

    def shifted(self, extra: Mapping[str, int], note: str) -> PhaseTrace:
        """The same phase with ``extra`` bytes live throughout (added to their categories)."""
        total = sum(extra.values())
        categories = dict(self.categories)
        for name, value in extra.items():
            categories[name] += value
        return replace(
            self,
            peak_bytes=self.peak_bytes + total,
            categories=categories,
            curve=self.curve + total,
            start_bytes=self.start_bytes + total,
            segment_bytes=self.segment_bytes + total,
            included=dict(self.included),
            notes=[*self.notes, note],
            segment_parts=(*self.segment_parts[:2], self.segment_parts[2] + total),
        )


class Recorder(StorageCounter, TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Count live storage bytes, FLOPs and bytes moved per operator; keep the peak's storages.

    Enter it inside a ``FakeTensorMode`` (or on real tensors: it counts them the same way).
    ``round_to`` rounds every storage up as an allocator would (CUDA's caching allocator: 512);
    the storages are counted as :class:`~lightning_pilot.core.storage_count.StorageCounter`
    counts them, with the storages live at each phase's peak kept.

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
        super().__init__(round_to, snapshots=True)
        self.fake_only = fake_only
        self._peak_op = 0
        self.saved: set[int] = set()
        self._phase = ""
        self._start = 0
        self._curve: list[int] = []
        self._flops: list[int] = []
        self._moved: list[int] = []
        self._kinds: list[int] = []
        self._names: list[str] = []
        # The (serial, bytes) of the storages each operator's outputs newly allocate.
        self._allocated: list[list[tuple[int, int]]] = []
        self.held: set[int] = set()
        #: The routing assumption for a router's ``topk`` on fake scores (``"balanced"``), or
        #: ``None``: reading the experts' tokens is then untraceable.
        self.routing: str | None = "balanced"
        #: The busiest expert's share of the tokens over the balanced share (1: balanced).
        self.capacity_factor = 1.0
        #: ``(experts, top_k)`` of every ``topk`` routed under the assumption.
        self.routed: set[tuple[int, int]] = set()
        self._registry = _flop_registry()

    def record(self, tensor: torch.Tensor) -> int | None:
        """Count ``tensor``'s storage (once); return its serial number. With ``fake_only``,
        real tensors (the user's batch, the real copies of values) are not counted."""
        if self.fake_only and not isinstance(tensor, FakeTensor):
            return None
        return self.count(tensor)

    def serial(self, tensor: torch.Tensor) -> int | None:
        """The serial number of ``tensor``'s storage, counting it if new."""
        return self.record(tensor)

    def _peaked(self) -> None:
        self._peak_op = len(self._curve)  # the operator being counted

    def begin(self, phase: str) -> None:
        """Start a phase: the peak restarts at the current level."""
        self._phase = phase
        self.reset_peak()
        self._start = self.current_bytes
        self._peak_op = 0
        self._curve, self._flops, self._moved, self._kinds, self._names = [], [], [], [], []
        self._allocated = []

    def end(self, classes: Mapping[str, set[int]] | None = None) -> PhaseTrace:
        """End the phase: its trace, with the peak's storages sorted into ``classes``
        (category -> serial numbers; what is in none is ``temporaries``)."""
        classes = classes or {}
        snapshot = self.peak_storages()
        categories = dict.fromkeys(CATEGORIES, 0)
        parts = _segment_parts(nbytes for _, nbytes in snapshot.values())
        ordered = [(name, classes.get(name, set())) for name in CATEGORIES[:-1]]
        requests, count, grads = _requests(self._allocated, classes.get("grad", set()))
        for serial, nbytes in snapshot.values():
            for name, members in ordered:
                if serial in members:
                    categories[name] += nbytes
                    break
            else:
                categories["temporaries"] += nbytes
        return PhaseTrace(
            phase=self._phase,
            peak_bytes=self.peak_bytes,
            categories=categories,
            curve=np.asarray(self._curve, dtype=np.int64),
            flops=np.asarray(self._flops, dtype=np.int64),
            moved=np.asarray(self._moved, dtype=np.int64),
            kinds=np.asarray(self._kinds, dtype=np.int8),
            peak_op=self._peak_op,
            signature=operator_signature(names := tuple(self._names)),
            start_bytes=self._start,
            segment_bytes=segment_bytes(parts),
            names=names,
            segment_parts=parts,
            requests=requests,
            request_count=count,
            grad_requests=grads,
        )

    def saved_hooks(self) -> Any:
        """``saved_tensors_hooks`` marking what autograd saves as activations."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            serial = self.record(tensor)
            if serial is not None:
                self.saved.add(serial)
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

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
        inputs = _inputs(args, kwargs)
        outputs = _tensors((out,))
        record = self.record
        for tensor in inputs:
            record(tensor)
        allocated = []
        for tensor in outputs:
            newest = self._serial  # the counter's newest serial: a larger one is new
            serial = record(tensor)
            if serial is not None and serial > newest:  # a storage this operator allocated
                allocated.append((serial, self.live[id(tensor.untyped_storage())][1]))
        self._allocated.append(allocated)
        flops = moved = kind = 0
        if not func.is_view and func not in _ALIASES:
            moved = sum(t.numel() * t.element_size() for t in (*inputs, *outputs))
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
        self._curve.append(self.current_bytes)
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
        values = (args, dict(kwargs))
        tensors = [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor)]
        if any(_shadow_of(tensor) is None for tensor in tensors):
            return None
        real_args, real_kwargs = tree_map(
            lambda v: _shadow_of(v) if isinstance(v, torch.Tensor) else v, values
        )
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


_SMALL: Final = 1 << 20
_MID: Final = 10 << 20
_SEGMENT: Final = 2 << 20
_MID_SEGMENT: Final = 20 << 20


def _requests(
    allocated: list[list[tuple[int, int]]], grads: set[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per operator: the smallest block it allocates other than a gradient, how many such
    blocks, and the bytes of the gradients it allocates."""
    requests, count, grad = np.zeros((3, len(allocated)), dtype=np.int64)
    for index, blocks in enumerate(allocated):
        others = [nbytes for serial, nbytes in blocks if serial not in grads]
        grad[index] = sum(nbytes for serial, nbytes in blocks if serial in grads)
        if others:
            requests[index], count[index] = min(others), len(others)
    return requests, count, grad


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
