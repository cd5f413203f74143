"""The one storage counter: :class:`~lightning_pilot.core.memory.TensorTracker` (real tensors)
and :class:`~lightning_pilot.estimate.recorder.Recorder` (the estimate's fake tensors) subclass
:class:`StorageCounter`, so the trace and the tracker count the same bytes."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from lightning_pilot.core import validate


class StorageCounter:
    """Live and peak bytes of the storages behind the tensors given to :meth:`count`.

    A storage counts once (views share it) from the first tensor counted on it until it is
    freed (a weak reference takes its bytes off). ``round_to`` rounds each storage up to a
    multiple of that many bytes, as an allocator's blocks (CUDA's: 512). ``peak_bytes`` is the
    most live at once since :meth:`reset_peak`; with ``snapshots``, :meth:`peak_storages` tells
    which storages were live then. Subclasses feed :meth:`count` and may override
    :meth:`_peaked`, called at each new peak."""

    def __init__(self, round_to: int = 1, *, snapshots: bool = False) -> None:
        super().__init__()  # the next class of a subclass (a dispatch mode) gets its turn
        owner = type(self).__name__
        self.round_to = validate.integer(owner, "round_to", round_to, minimum=1)
        self.snapshots = validate.boolean(owner, "snapshots", snapshots)
        #: ``id(storage) -> (serial, bytes)`` of every live storage counted.
        self.live: dict[int, tuple[int, int]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, weakref.ref[Any]] = {}  # their callbacks free the storages
        self._self_ref = weakref.ref(self)
        self._serial = 0
        self._snapshot: dict[int, tuple[int, int]] | None = None
        self._dirty = False  # a new peak since the last snapshot (only with snapshots)

    def count(self, tensor: torch.Tensor) -> int | None:
        """Count ``tensor``'s storage (once); its serial number (1, 2, ... in order first
        counted), or ``None`` without a plain storage (sparse, nested)."""
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        key = id(storage)
        known = self.live.get(key)
        if known is not None:
            return known[0]
        nbytes = -(-int(storage.nbytes()) // self.round_to) * self.round_to
        self._serial += 1
        self.live[key] = (self._serial, nbytes)
        self._refs[key] = weakref.ref(storage, self._freer(key))
        self.current_bytes += nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._dirty = self.snapshots
            self._peaked()
        return self._serial

    def _peaked(self) -> None:
        """Called at each new peak, right after ``peak_bytes`` rose."""

    def _freer(self, key: int) -> Callable[[Any], None]:
        # Not a bound method: a storage outliving the counter keeps no counter alive.
        counter = self._self_ref

        def free(_: Any) -> None:
            owner = counter()
            if owner is None:
                return
            if owner._dirty:  # the first free after a new peak: what was live at it
                owner._snapshot = dict(owner.live)
                owner._dirty = False
            known = owner.live.pop(key, None)
            owner._refs.pop(key, None)
            if known is not None:
                owner.current_bytes -= known[1]

        return free

    def reset_peak(self) -> None:
        """Restart the peak at the current level (as CUDA's ``reset_peak_memory_stats``)."""
        self.peak_bytes = self.current_bytes
        self._snapshot = None
        self._dirty = self.snapshots

    def live_serials(self) -> set[int]:
        """The serial numbers of every live storage."""
        return {serial for serial, _ in self.live.values()}

    def peak_storages(self) -> dict[int, tuple[int, int]]:
        """``id(storage) -> (serial, bytes)`` of the storages live at the peak."""
        if not self.snapshots:
            raise ValueError(
                f"{type(self).__name__}.peak_storages() needs the peak's storages kept: create"
                f" it with snapshots=True"
            )
        if self._dirty or self._snapshot is None:
            self._snapshot = dict(self.live)
            self._dirty = False
        return self._snapshot
