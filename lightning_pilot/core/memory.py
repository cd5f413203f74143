"""Memory probes: device counters, a CPU tensor tracker, the training-state breakdown, host RAM.

Counters, chosen by the device the model is on (the phase table's ``counter`` column):
``cuda_allocator`` (:class:`CudaCounter`) and ``accelerator_allocator``
(:class:`AcceleratorCounter`) read the allocator: allocated bytes (live tensors) and reserved
bytes (segments held) are reported apart, and since ``reset_peak_memory_stats`` sets the peak to
the *current* level, the baseline at each phase start is reported too. ``cpu_tensor_tracker``
(:class:`TrackerCounter`): no CPU allocator keeps counts, so :class:`TensorTracker`, a
``TorchDispatchMode``, follows every storage operators touch until it is freed (live tensor
bytes; no "reserved"). ``none`` (:class:`NoCounter`): every memory value is null.

:func:`state_bytes` counts the parameter, gradient, optimizer-state and buffer bytes from the
tensors themselves (shared storages once), per device; :func:`host_memory` reads RSS and swap.

Example:
    >>> import torch
    >>> from lightning_pilot.core.memory import TensorTracker
    >>> tracker = TensorTracker()
    >>> with tracker:
    ...     x = torch.ones(1000)        # 4,000 bytes
    ...     y = x * 2                   # 4,000 more
    ...     tracker.peak_bytes
    8000
    >>> del x, y
    >>> tracker.current_bytes
    0
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "AcceleratorCounter",
    "CudaCounter",
    "MemoryCounter",
    "MemoryReading",
    "NoCounter",
    "StateBytes",
    "TensorTracker",
    "TrackerCounter",
    "host_memory",
    "state_bytes",
]


class TensorTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Count live tensor bytes on any device by following every storage operators touch.

    Every tensor an operator takes or returns is recorded by its storage (views share one) with
    a weak-reference callback that subtracts its bytes when the storage is freed. Tensors that
    exist before tracking starts are counted once an operator touches them, or at once through
    :meth:`adopt` (the training state: parameters, gradients, optimizer state).

    Use it as a context manager, or :meth:`start` / :meth:`stop` across hooks (the mode must be
    the innermost active dispatch mode when it stops). The cost is one Python call per operator
    while active, so callers keep it active only during measured steps.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[Any]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.active = False

    # The mode is entered and left across Lightning hooks, so it offers explicit calls too.
    def start(self) -> None:
        """Begin tracking (idempotent)."""
        if not self.active:
            self.__enter__()

    def stop(self) -> None:
        """Stop tracking (idempotent); live storages stay counted until freed."""
        if self.active:
            self.__exit__(None, None, None)

    def __enter__(self) -> TensorTracker:
        super().__enter__()  # type: ignore[no-untyped-call]
        self.active = True
        return self

    def __exit__(self, *args: Any) -> None:
        self.active = False
        super().__exit__(*args)  # type: ignore[no-untyped-call]

    def reset_peak(self) -> None:
        """Set the peak to the current level (as CUDA's ``reset_peak_memory_stats`` does)."""
        self.peak_bytes = self.current_bytes

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that already exist (their storages, once)."""
        for tensor in tensors:
            self._record(tensor)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        # A hand-written walk of the usual shapes (tensors and flat lists of them) is several
        # times cheaper than a generic pytree flatten on every operator.
        record = self._record
        for value in (*args, out):
            if isinstance(value, torch.Tensor):
                record(value)
            elif isinstance(value, list | tuple):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        record(item)
        if kwargs:
            for value in tree_flatten(kwargs)[0]:
                if isinstance(value, torch.Tensor):
                    record(value)
        return out

    def _record(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return  # sparse, nested or fake tensors have no plain storage
        key = id(storage)
        if key in self._live:
            return
        nbytes = int(storage.nbytes())
        self._live[key] = nbytes
        self._refs[key] = weakref.ref(storage, self._freer(key))
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _freer(self, key: int) -> Any:
        # A plain closure (not a bound method) so the weak reference keeps no tracker alive.
        tracker = weakref.ref(self)

        def free(_: Any) -> None:
            owner = tracker()
            if owner is not None:
                owner.current_bytes -= owner._live.pop(key, 0)
                owner._refs.pop(key, None)

        return free


@dataclass(frozen=True)
class MemoryReading:
    """Memory of one measured phase. ``None`` means not measured, never zero."""

    baseline_allocated_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    end_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    device_capacity_bytes: int | None = None


class MemoryCounter(Protocol):
    """What the monitor needs from a memory counter."""

    name: str
    note: str | None

    def synchronize(self) -> None:
        """Wait for queued device work (durations need it; allocator counters do not)."""

    def begin(self) -> None:
        """Record the baseline and reset the peak, at a phase start."""

    def end(self) -> MemoryReading:
        """Read the peak and the end level, at a phase end."""


class NoCounter:
    """No counter exists for this device: every memory value is null."""

    name = "none"

    def __init__(self, note: str) -> None:
        self.note: str | None = note

    def synchronize(self) -> None:
        return None

    def begin(self) -> None:
        return None

    def end(self) -> MemoryReading:
        return MemoryReading()


class AcceleratorCounter:
    """Allocator counters through ``torch.accelerator`` (allocated and reserved kept apart)."""

    name = "accelerator_allocator"
    note: str | None = None

    def __init__(self, device: torch.device, api: Any = None) -> None:
        self.device = device
        self._api = api if api is not None else torch.accelerator
        self._baseline = 0
        self._retries = 0
        self._capacity: int | None = None

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether ``torch.accelerator`` can count memory of ``device``."""
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is None or not hasattr(accelerator, "memory_allocated"):
            return False
        try:
            accelerator.memory_allocated(device)
        except (RuntimeError, ValueError, TypeError, AssertionError):
            return False
        return True

    def synchronize(self) -> None:
        self._api.synchronize(self.device)

    def begin(self) -> None:
        self._baseline = int(self._api.memory_allocated(self.device))
        self._retries = int(self._api.memory_stats(self.device).get("num_alloc_retries", 0))
        self._api.reset_peak_memory_stats(self.device)

    def _total(self) -> int | None:
        try:
            return int(self._api.get_memory_info(self.device)[1])
        except (RuntimeError, AttributeError, TypeError):
            return None

    def end(self) -> MemoryReading:
        api, device = self._api, self.device
        if self._capacity is None:
            self._capacity = self._total()
        return MemoryReading(
            baseline_allocated_bytes=self._baseline,
            peak_allocated_bytes=int(api.max_memory_allocated(device)),
            end_allocated_bytes=int(api.memory_allocated(device)),
            peak_reserved_bytes=int(api.max_memory_reserved(device)),
            alloc_retries=int(api.memory_stats(device).get("num_alloc_retries", 0)) - self._retries,
            device_capacity_bytes=self._capacity,
        )


class CudaCounter(AcceleratorCounter):
    """CUDA caching-allocator counters of one device, through ``torch.cuda``."""

    name = "cuda_allocator"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, torch.cuda)

    def _total(self) -> int | None:
        return int(torch.cuda.mem_get_info(self.device)[1])


class TrackerCounter:
    """CPU memory from a :class:`TensorTracker` (live tensor bytes; no reserved on CPU)."""

    name = "cpu_tensor_tracker"
    note: str | None = (
        "peak_reserved_bytes is null: a CPU has no caching allocator; allocated bytes are the"
        " live tensor bytes seen by the tensor tracker; device_capacity_bytes is host RAM"
    )

    def __init__(self, tracker: TensorTracker) -> None:
        self.tracker = tracker
        self._baseline = 0

    def synchronize(self) -> None:
        return None

    def begin(self) -> None:
        self._baseline = self.tracker.current_bytes
        self.tracker.reset_peak()

    def end(self) -> MemoryReading:
        return MemoryReading(
            baseline_allocated_bytes=self._baseline,
            peak_allocated_bytes=self.tracker.peak_bytes,
            end_allocated_bytes=self.tracker.current_bytes,
            peak_reserved_bytes=None,
            alloc_retries=None,
            device_capacity_bytes=host_memory().total_bytes,
        )


@dataclass
class StateBytes:
    """Bytes of parameters, gradients, optimizer state and buffers, in total and per device."""

    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    buffer_bytes: int = 0
    by_device: dict[tuple[str, str], int] = field(default_factory=dict)

    def totals(self) -> dict[str, int]:
        """The four totals by column name (the phase table's ``*_bytes`` columns)."""
        return {
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "buffer_bytes": self.buffer_bytes,
        }

    def placement_rows(self) -> list[dict[str, Any]]:
        """One row per (device, kind): where the weights and the training state sit."""
        return [
            {"device": device, "kind": kind, "bytes": nbytes}
            for (device, kind), nbytes in sorted(self.by_device.items())
        ]


def _storage_of(tensor: torch.Tensor) -> tuple[tuple[str, int] | None, int]:
    """The storage identity (device, address) and its bytes; one storage lookup per tensor."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None, int(tensor.numel() * tensor.element_size())
    return (tensor.device.type + str(tensor.device.index), storage.data_ptr()), storage.nbytes()


def _optimizer_tensors(optimizers: Iterable[Any]) -> Iterator[torch.Tensor]:
    for optimizer in optimizers:
        state = getattr(optimizer, "state", None)
        if not isinstance(state, Mapping):
            continue
        for per_param in state.values():
            if isinstance(per_param, Mapping):
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        yield value


def state_bytes(module: torch.nn.Module, optimizers: Iterable[Any] = ()) -> StateBytes:
    """Exact bytes of the training state, each storage counted once.

    Optimizer-state scalars such as Adam's ``step`` count too (they are tensors that live
    somewhere). With AdamW in fp32 the optimizer state after the first step is twice the
    trainable parameter bytes plus one small ``step`` tensor per parameter.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(10, 10)            # 110 float32 parameters
        >>> state_bytes(layer).param_bytes
        440
    """
    seen: set[tuple[str, int]] = set()
    result = StateBytes()

    def add(tensor: torch.Tensor, kind: str) -> int:
        key, nbytes = _storage_of(tensor)
        if key is not None:
            if key in seen:
                return 0
            seen.add(key)
        slot = (str(tensor.device), kind)
        result.by_device[slot] = result.by_device.get(slot, 0) + nbytes
        return nbytes

    for param in module.parameters():
        result.param_bytes += add(param, "param")
    for param in module.parameters():
        if param.grad is not None:
            result.grad_bytes += add(param.grad, "grad")
    for buffer in module.buffers():
        result.buffer_bytes += add(buffer, "buffer")
    for value in _optimizer_tensors(optimizers):
        result.optimizer_state_bytes += add(value, "optimizer_state")
    return result


def state_tensors(
    module: torch.nn.Module, optimizers: Iterable[Any] = ()
) -> Iterator[torch.Tensor]:
    """Every tensor of the training state (for :meth:`TensorTracker.adopt`)."""
    for param in module.parameters():
        yield param
        if param.grad is not None:
            yield param.grad
    yield from module.buffers()
    yield from _optimizer_tensors(optimizers)


@dataclass(frozen=True)
class HostMemory:
    """Host memory facts; ``None`` where the platform does not tell."""

    rss_bytes: int | None
    total_bytes: int | None
    swap_used_bytes: int | None
    note: str | None = None


def _read_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    values: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path, encoding="ascii") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name in keys:
                values[name] = int(rest.split()[0]) * 1024
    return values


def host_memory() -> HostMemory:
    """Resident memory of this process, host RAM and swap in use (Linux ``/proc``).

    Elsewhere the values are ``None`` with a note, never zero.
    """
    if not os.path.exists("/proc/self/status"):
        return HostMemory(None, None, None, note="host memory needs Linux /proc")
    status = _read_kib("/proc/self/status", ("VmRSS",))
    info = _read_kib("/proc/meminfo", ("MemTotal", "SwapTotal", "SwapFree"))
    swap = None
    if "SwapTotal" in info and "SwapFree" in info:
        swap = info["SwapTotal"] - info["SwapFree"]
    return HostMemory(
        rss_bytes=status.get("VmRSS"), total_bytes=info.get("MemTotal"), swap_used_bytes=swap
    )
