"""Memory probes: a counter per value of the phase table's ``counter`` column
(docs/phase-table.md), the CPU tensor tracker, the training-state breakdown, host RAM."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_pilot.core.storage_count import StorageCounter


def compiled_code(module: torch.nn.Module) -> list[str]:
    """Where ``module`` holds ``torch.compile`` code, by name (``<root>``: the module itself):
    compiled submodules, modules compiled in place, a LightningModule compiled whole, compiled
    methods, and compiled functions at the top level of a module class's Python module. ``[]``
    when nothing is. Dynamo does not compile under a :class:`TensorTracker` (a dispatch mode),
    and then runs that frame uncompiled for good: the tracker must stay off for such a module."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # torch.compile imports it: nothing was compiled in this process
        return []

    def compiled(namespace: Mapping[str, Any]) -> list[str]:
        return [
            name
            for name, value in list(namespace.items())
            # Dynamo's own entries (__compiled_fn_*, __resume_at_*) are what it made, not code.
            if not name.startswith("__")
            and callable(value)
            and hasattr(value, "_torchdynamo_orig_callable")
        ]

    found: list[str] = []
    seen: set[Any] = set()  # classes and Python modules already searched
    for name, sub in module.named_modules():
        label = name or "<root>"
        if isinstance(sub, eval_frame.OptimizedModule):
            found.append(label)
            continue
        if getattr(sub, "_compiled_call_impl", None) is not None:
            found.append(f"{label} (Module.compile)")
        elif getattr(sub, "_compiler_ctx", None):  # its compiled methods come with it
            found.append(f"{label} (torch.compile of the LightningModule)")
        else:
            found.extend(f"{label}.{attribute}" for attribute in compiled(vars(sub)))
        for cls in type(sub).__mro__:
            if cls in seen or cls.__module__.startswith(("torch.", "lightning.", "builtins")):
                continue
            seen.add(cls)
            found.extend(f"{cls.__qualname__}.{attribute}" for attribute in compiled(vars(cls)))
            home = sys.modules.get(cls.__module__)
            if home is not None and home not in seen:
                seen.add(home)
                found.extend(f"{home.__name__}.{function}" for function in compiled(vars(home)))
    return found


class TensorTracker(StorageCounter, TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Live tensor bytes on any device: a :class:`~lightning_pilot.core.storage_count.
    StorageCounter` fed every tensor operators touch (older tensors through :meth:`adopt`); a
    context manager, or :meth:`start` / :meth:`stop` across hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

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

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that already exist (their storages, once)."""
        for tensor in tensors:
            self.count(tensor)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        # Walking tensors and flat lists by hand is several times cheaper than a pytree flatten.
        count = self.count
        for value in (*args, out, *(tree_flatten(kwargs)[0] if kwargs else ())):
            if isinstance(value, torch.Tensor):
                count(value)
            elif isinstance(value, list | tuple):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        count(item)
        return out


@dataclass(frozen=True)
class MemoryReading:
    """Memory of one measured phase. ``None`` means not measured, never zero."""

    baseline_allocated_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    end_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    device_capacity_bytes: int | None = None


class MemoryCounter:
    """What the monitor needs from a memory counter; this base measures nothing."""

    name: str
    note: str | None = None

    def synchronize(self) -> None:
        """Wait for queued device work."""

    def begin(self) -> None:
        """Record the baseline and reset the peak, at a phase start."""

    def end(self) -> MemoryReading:
        """The peak and the end level, at a phase end."""
        return MemoryReading()


class NoCounter(MemoryCounter):
    """No counter exists for this device: every memory value is null."""

    name = "none"

    def __init__(self, note: str) -> None:
        self.note = note


class AcceleratorCounter(MemoryCounter):
    """Allocator counters through ``torch.accelerator`` (allocated and reserved kept apart)."""

    name = "accelerator_allocator"

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


class TrackerCounter(MemoryCounter):
    """CPU memory from a :class:`TensorTracker` (live tensor bytes; no reserved on CPU)."""

    name = "cpu_tensor_tracker"
    note = (
        "peak_reserved_bytes is null: a CPU has no caching allocator; allocated bytes are the"
        " live tensor bytes seen by the tensor tracker; device_capacity_bytes is host RAM"
    )

    def __init__(self, tracker: TensorTracker) -> None:
        self.tracker = tracker
        self._baseline = 0

    def begin(self) -> None:
        self._baseline = self.tracker.current_bytes
        self.tracker.reset_peak()

    def end(self) -> MemoryReading:
        return MemoryReading(
            baseline_allocated_bytes=self._baseline,
            peak_allocated_bytes=self.tracker.peak_bytes,
            end_allocated_bytes=self.tracker.current_bytes,
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
        return {name: value for name, value in vars(self).items() if name != "by_device"}

    def placement_rows(self) -> list[dict[str, Any]]:
        """One row per (device, kind): where the weights and the training state sit."""
        return [
            {"device": device, "kind": kind, "bytes": nbytes}
            for (device, kind), nbytes in sorted(self.by_device.items())
        ]


def _state(module: torch.nn.Module, optimizers: Iterable[Any]) -> Iterator[tuple[str, Any]]:
    """``(kind, tensor)`` of every tensor of the training state."""
    yield from (("param", param) for param in module.parameters())
    yield from (("grad", p.grad) for p in module.parameters() if p.grad is not None)
    yield from (("buffer", buffer) for buffer in module.buffers())
    for optimizer in optimizers:
        state = getattr(optimizer, "state", None)
        for per_param in state.values() if isinstance(state, Mapping) else ():
            if isinstance(per_param, Mapping):
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        yield "optimizer_state", value


def state_bytes(module: torch.nn.Module, optimizers: Iterable[Any] = ()) -> StateBytes:
    """Exact bytes of the training state, each storage counted once."""
    seen: set[tuple[str, int]] = set()
    result = StateBytes()
    for kind, tensor in _state(module, optimizers):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            nbytes = int(tensor.numel() * tensor.element_size())
        else:
            key = (tensor.device.type + str(tensor.device.index), storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            nbytes = storage.nbytes()
        setattr(result, f"{kind}_bytes", getattr(result, f"{kind}_bytes") + nbytes)
        slot = (str(tensor.device), kind)
        result.by_device[slot] = result.by_device.get(slot, 0) + nbytes
    return result


def state_tensors(
    module: torch.nn.Module, optimizers: Iterable[Any] = ()
) -> Iterator[torch.Tensor]:
    """Every tensor of the training state (for :meth:`TensorTracker.adopt`)."""
    return (tensor for _, tensor in _state(module, optimizers))


@dataclass(frozen=True)
class HostMemory:
    """Host memory facts; ``None`` where the platform does not tell."""

    rss_bytes: int | None
    total_bytes: int | None
    swap_used_bytes: int | None


def _read_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    values: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path, encoding="ascii") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name in keys:
                values[name] = int(rest.split()[0]) * 1024
    return values


def host_memory() -> HostMemory:
    """This process's resident memory, host RAM and swap in use (Linux ``/proc``; else ``None``)."""
    status = _read_kib("/proc/self/status", ("VmRSS",))
    info = _read_kib("/proc/meminfo", ("MemTotal", "SwapTotal", "SwapFree"))
    swap = (
        info["SwapTotal"] - info["SwapFree"] if {"SwapTotal", "SwapFree"} <= info.keys() else None
    )
    return HostMemory(status.get("VmRSS"), info.get("MemTotal"), swap)
