"""What crosses the process boundary: :class:`Request` and :class:`Result`, dataclasses that
round-trip through JSON; ``from_dict`` validates an untrusted file, raising :class:`ProtocolError`
naming the key path (docs/resume.md)."""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Final, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from lightning_pilot.core.resume import StepRecord

M = TypeVar("M", bound="_Message")

#: The environment variable that names the training process (the parent not to outlive).
PARENT_PID: Final = "LIGHTNING_PILOT_PARENT_PID"


class ProtocolError(ValueError):
    """A request or result that does not match the protocol; the message names the key path."""


class _Message:
    def to_dict(self) -> dict[str, Any]:
        """The message as JSON values."""
        return dict(_encode(self))

    @classmethod
    def from_dict(cls: type[M], data: object) -> M:
        """Read a message from JSON values; :class:`ProtocolError` when they do not match it."""
        return cast(M, _decode(cls, data, cls.__name__))


@dataclass(frozen=True)
class ResumeTask(_Message):
    """Resume ``fit`` from ``checkpoint`` in a module (and datamodule) rebuilt by ``factory`` or
    from their classes, and record what follows. ``trainer`` holds the Trainer's keyword
    arguments, ``adapter`` the BatchAdapter's key and index fields, ``ddp`` the ``DDPStrategy``
    options when the new process is one rank of a DDP group like the fit's; ``fit_loaders``:
    the training loaders passed to ``fit`` come pickled on the new process's stdin."""

    checkpoint: str
    state_key: str
    module_class: str
    workdir: str
    trainer: dict[str, Any]
    factory: str | None = None
    datamodule_class: str | None = None
    dataset_fingerprint: str | None = None
    adapter: dict[str, str | int] = field(default_factory=dict)
    ddp: dict[str, Any] | None = None
    fit_loaders: bool = False
    kind: Literal["resume"] = "resume"


@dataclass(frozen=True)
class ArtifactTask(_Message):
    """Load ``artifact`` strictly into a module rebuilt from ``checkpoint`` (cast to ``dtype``)
    and save its outputs on the control batches (``control``) to ``outputs``, reached the way
    ``call`` names (``"predict_step"``, ``"forward(batch)"``, ...)."""

    checkpoint: str
    artifact: str
    control: str
    call: str
    outputs: str
    module_class: str
    factory: str | None = None
    dtype: str | None = None
    kind: Literal["artifact"] = "artifact"


@dataclass(frozen=True)
class Request(_Message):
    """The tasks one new process runs in order, where it writes its :class:`Result`, and the
    training process's thread count (CPU reductions, and so losses, depend on it)."""

    tasks: tuple[ResumeTask | ArtifactTask, ...]
    result: str
    num_threads: int


@dataclass(frozen=True)
class State(_Message):
    """What a resume must restore, as comparable values (digests of the large states)."""

    global_step: int
    epoch: int
    lrs: list[float]
    optimizer_state: str
    scheduler_state: str
    grad_scaler: str | None
    weights: str
    rng: str | None = None


@dataclass
class TaskResult(_Message):
    """What one task found: failures that are the answer are fields, never exceptions
    (``blocked``, ``where`` and ``data_source``: the training process's notes;
    ``loader_error``: the loaders passed to ``fit`` did not unpickle in the new process)."""

    kind: Literal["resume", "artifact"]
    blocked: str | None = None
    where: str = "a new process"
    crash: str | None = None
    traceback: str | None = None
    load_error: str | None = None
    unsafe_globals: list[str] = field(default_factory=list)
    load_seconds: float | None = None
    load_rss_bytes: int | None = None
    file_bytes: int | None = None
    build_error: str | None = None
    build_order: str | None = None
    loader_error: str | None = None
    data_source: str | None = None
    dataset_fingerprint: str | None = None
    restored: State | None = None
    steps: list[StepRecord] = field(default_factory=list)
    global_step_end: int = 0
    artifact_error: str | None = None
    outputs: str | None = None


@dataclass(frozen=True)
class Result(_Message):
    """One :class:`TaskResult` per task of the :class:`Request`, in order."""

    tasks: tuple[TaskResult, ...]


def _encode(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


@functools.cache
def _name(kind: Any) -> str:
    if get_origin(kind) in (Union, types.UnionType):
        return " | ".join(_name(a) for a in get_args(kind))
    return "None" if kind is type(None) else getattr(kind, "__name__", str(kind))


def _tag(kind: Any) -> object:
    return next((f.default for f in fields(kind) if f.name == "kind"), None)


def _decode(kind: Any, value: Any, where: str) -> Any:
    origin, args = get_origin(kind), get_args(kind)
    if kind is Any:
        return value
    if isinstance(kind, type) and is_dataclass(kind):
        return _decode_fields(kind, value, where)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        if isinstance(value, Mapping):  # a message: the one its "kind" names, with its errors
            named = [a for a in options if is_dataclass(a) and _tag(a) in (None, value.get("kind"))]
            options = named or options
        if len(options) == 1:
            return _decode(options[0], value, where)
        for option in options:
            with contextlib.suppress(ProtocolError):
                return _decode(option, value, where)
    elif origin in (list, tuple) and isinstance(value, list | tuple):
        return origin(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    elif origin is dict and isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _decode(args[1], v, f"{where}.{k}") for k, v in value.items()}
    elif _is_scalar(kind, origin, args, value):
        return float(value) if kind is float else value
    raise ProtocolError(f"{where} is {repr(value)[:80]}, expected {_name(kind)}")


def _is_scalar(kind: Any, origin: Any, args: tuple[Any, ...], value: Any) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is float:  # JSON writes 2.0 as 2.0 but a user's learning rate may be the int 2
        return isinstance(value, int | float) or value in ("nan", "inf", "-inf")
    if origin is Literal:
        return isinstance(value, str) and value in args
    return kind in (int, str, type(None)) and isinstance(value, kind)


def _decode_fields(cls: type, value: Any, where: str) -> Any:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{where} is {repr(value)[:80]}, expected an object ({cls.__name__})")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(map(str, set(value) - set(known)))
    if unknown:
        raise ProtocolError(f"{where} has unknown key(s) {unknown}; known: {sorted(known)}")
    missing = [
        name
        for name, f in known.items()
        if name not in value and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise ProtocolError(f"{where} lacks the key(s) {missing}")
    hints = get_type_hints(cls)
    return cls(**{name: _decode(hints[name], v, f"{where}.{name}") for name, v in value.items()})
