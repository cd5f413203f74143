"""Pure pieces of resume verification: RNG states, digests, plain values, trajectory comparison
(docs/resume.md)."""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import torch

from lightning_pilot.core.phases import CheckResult
from lightning_pilot.core.split_scan import input_fingerprint

#: An example id as it crosses processes: a JSON scalar.
ExampleId = str | int | float | bool | None

#: The prefix of an example key made from the example's content (no id field in the batch).
CONTENT_KEY_PREFIX: Final = "content:"


def capture_rng() -> dict[str, Any]:
    """The torch, CUDA, numpy and Python RNG states in types ``weights_only=True`` loads."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = {
        "name": str(name),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    version, internal, gauss = random.getstate()
    state["python"] = {"version": int(version), "state": list(internal), "gauss": gauss}
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore states captured by :func:`capture_rng` (missing parts are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
    if "numpy" in state:
        saved = state["numpy"]
        keys = np.asarray(saved["keys"].numpy(), dtype=np.uint32)
        np.random.set_state(
            (saved["name"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
        )
    if "python" in state:
        saved = state["python"]
        random.setstate((saved["version"], tuple(saved["state"]), saved["gauss"]))


def rng_of_this_rank(state: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The RNG states to restore from a saved ``{"rng", "rng_by_rank"}``: this rank's own under
    several processes, else ``rng``."""
    by_rank = state.get("rng_by_rank")
    if isinstance(by_rank, list) and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
        if rank < len(by_rank) and isinstance(own := by_rank[rank], Mapping):
            return own
    rng = state.get("rng")
    return rng if isinstance(rng, Mapping) else None


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.numel():
            hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        hasher.update(b"{")
        for key in sorted(value, key=repr):
            hasher.update(repr(key).encode())
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, list | tuple):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
        hasher.update(b"]")
    else:
        hasher.update(repr(value).encode())


def digest(value: Any) -> str:
    """A 16-hex-digit sha256 of a nested value; tensors count by dtype, shape and bytes."""
    hasher = hashlib.sha256()
    _feed(hasher, value)
    return hasher.hexdigest()[:16]


def json_id(value: Any) -> ExampleId:
    """An example id as a JSON value: numbers, strings and booleans as they are, else ``str``."""
    return value if isinstance(value, int | float | str | bool) or value is None else str(value)


def content_keys(inputs: Any) -> list[str] | None:
    """One key per example from the bytes of its inputs (a tensor with a batch dimension, or a
    mapping of them keyed together: two CLIP pairs sharing a caption stay two examples), for
    batches without ids; ``None`` for other inputs."""
    parts = dict(inputs) if isinstance(inputs, Mapping) else {None: inputs}
    sizes = {
        part.shape[0] if isinstance(part, torch.Tensor) and part.dim() >= 1 else 0
        for part in parts.values()
    }
    if len(sizes) != 1 or not (count := sizes.pop()):
        return None
    rows = {key: part.detach().cpu() for key, part in parts.items()}  # one device read each
    if None in rows:
        return [f"{CONTENT_KEY_PREFIX}{input_fingerprint(row)}" for row in rows[None]]
    return [
        f"{CONTENT_KEY_PREFIX}{input_fingerprint({k: v[i] for k, v in rows.items()})}"
        for i in range(count)
    ]


def dataset_fingerprint(dataset: Any, count: int = 4) -> str | None:
    """A digest of the first ``count`` items of a map-style dataset (``None`` when it cannot be
    indexed or an item raises): did the new process build the fit's data?"""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        return None
    # The same random state on both sides, the caller's put back after.
    saved = capture_rng()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    try:
        items = [
            plain_values(dataset[index], others="raise")
            for index in range(min(count, len(dataset)))
        ]
    except Exception:  # the user's dataset, or an item of a kind not comparable across processes
        return None
    finally:
        restore_rng(saved)
    return digest(items)


_DROPPED: Final = object()


def plain_values(value: Any, *, others: Literal["drop", "raise"] = "drop") -> Any:
    """``value`` as what compares across processes and ``weights_only=True`` loads: CPU tensors
    (numpy arrays too), numbers, strings, bytes and lists and dicts of them; other objects are
    left out (``others="drop"``) or refused with ``TypeError`` (``others="raise"``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, bool | int | float | str | bytes) or value is None:
        return value
    if type(value).__module__ == "numpy":
        return torch.as_tensor(value)
    if isinstance(value, Mapping):
        kept = {str(k): plain_values(v, others=others) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not _DROPPED}
    if isinstance(value, list | tuple):
        return [v for v in (plain_values(x, others=others) for x in value) if v is not _DROPPED]
    if others == "raise":
        raise TypeError(f"{type(value).__name__} is not comparable across processes")
    return _DROPPED


def count_tensors(value: Any) -> int:
    """How many tensors a :func:`plain_values` value holds."""
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return sum(count_tensors(v) for v in value)
    return int(isinstance(value, torch.Tensor))


def outputs_close(a: Any, b: Any, atol: float = 0.0, rtol: float = 0.0) -> bool:
    """Whether two :func:`plain_values` values are equal: floating tensors within ``atol`` and
    ``rtol`` (NaN equals NaN), others exactly, same shapes, dtypes and keys."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True))
        return bool(torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(outputs_close(a[k], b[k], atol, rtol) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(
            outputs_close(x, y, atol, rtol) for x, y in zip(a, b, strict=True)
        )
    return bool(a == b)


_SAFE_SCALARS = (str, bytes, int, float, bool, complex, type(None))


def unsafe_values(value: Any, path: str = "") -> list[str]:
    """Key paths of values a weights-only load would refuse, with their type."""
    # Exact types: numpy scalars subclass float and int but need numpy globals to unpickle.
    if type(value) in _SAFE_SCALARS or isinstance(
        value, torch.Tensor | torch.Size | torch.dtype | torch.device
    ):
        return []
    if type(value) in (dict, OrderedDict):
        return [
            found
            for key, item in value.items()
            for found in unsafe_values(item, f"{path}.{key}" if path else str(key))
        ]
    if type(value) in (list, tuple, set):
        return [
            found
            for index, item in enumerate(value)
            for found in unsafe_values(item, f"{path}[{index}]")
        ]
    kind = type(value)
    return [f"{path or '<root>'} ({kind.__module__}.{kind.__qualname__})"]


@dataclass(frozen=True)
class StepRecord:
    """One training micro-batch: where it was, which examples it held, what it gave."""

    step: int
    batch_idx: int
    epoch: int
    ids: tuple[ExampleId, ...] | None
    loss: float | None
    lrs: tuple[float, ...] = ()


#: One compared micro-batch: its index, the reference's record, the resumed one (``None`` when
#: it never ran) and whether ids, loss and learning rates agree.
StepPair = tuple[int, StepRecord, StepRecord | None, bool]


def _close(a: float | None, b: float | None, atol: float, rtol: float) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) and math.isnan(b):
        return True
    return abs(a - b) <= atol + rtol * abs(b)


def compare_trajectories(
    reference: Sequence[StepRecord],
    resumed: Sequence[StepRecord],
    *,
    seen_before: set[Any],
    loader_stateful: bool,
    at_epoch_boundary: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
    lr_cause: str = "",
) -> tuple[list[CheckResult], list[StepPair]]:
    """The checks ``data_position``, ``loss_trajectory`` and ``lr_trajectory`` after a resume,
    and one :data:`StepPair` per reference micro-batch; ``seen_before``: the ids the reference
    saw before the checkpoint in its epoch; ``atol``/``rtol`` (0: exact) for losses and rates;
    ``lr_cause``: a known cause, added when the rates differ."""
    pairs: list[StepPair] = []
    first: dict[str, tuple[int, StepRecord, StepRecord]] = {}  # each one's first difference
    for index, ref in enumerate(reference):
        got = resumed[index] if index < len(resumed) else None
        if got is None:
            pairs.append((index, ref, None, False))
            continue
        equal = {
            "ids": ref.ids is None or ref.ids == got.ids,
            "loss": _close(got.loss, ref.loss, atol, rtol),
            "lrs": len(ref.lrs) == len(got.lrs)
            and all(_close(a, b, atol, rtol) for a, b in zip(got.lrs, ref.lrs, strict=False)),
        }
        for key in (key for key, same in equal.items() if not same):
            first.setdefault(key, (index, ref, got))
        pairs.append((index, ref, got, all(equal.values())))
    counts = len(reference), len(resumed)
    return [
        _data_check(
            reference, resumed, first.get("ids"), seen_before, loader_stateful, at_epoch_boundary
        ),
        _value_check("loss_trajectory", "loss", first.get("loss"), *counts),
        _value_check("lr_trajectory", "learning rates", first.get("lrs"), *counts, lr_cause),
    ], pairs


def _data_check(
    reference: Sequence[StepRecord],
    resumed: Sequence[StepRecord],
    first: tuple[int, StepRecord, StepRecord] | None,
    seen_before: set[Any],
    loader_stateful: bool,
    at_epoch_boundary: bool,
) -> CheckResult:
    check = functools.partial(CheckResult, "data_position")
    if not reference or all(r.ids is None for r in reference):
        hint = ""
        if not loader_stateful:
            hint = (
                "; note that the training loader is not stateful, so a mid-epoch resume"
                " starts its order over (use torchdata's StatefulDataLoader)"
            )
        return check(
            "not_checked",
            f"batches carry no example ids: add an id field or give BatchAdapter(ids=...){hint}",
        )
    if first is None:
        if len(resumed) < len(reference):
            return check(
                "fail",
                f"only {len(resumed)} of {len(reference)} micro-batches ran after the resume",
            )
        by_content = any(
            isinstance(i, str) and i.startswith(CONTENT_KEY_PREFIX) for i in reference[0].ids or ()
        )
        how = " (examples told apart by the bytes of their inputs: the batches carry no id field)"
        return check("pass", f"{len(reference)} micro-batches identical{how if by_content else ''}")
    index, ref, got = first
    resumed_ids = {i for record in resumed for i in (record.ids or ())}
    replayed = resumed_ids & seen_before
    where = f"micro-batch {index} (step {ref.step}): expected ids {list(ref.ids or ())[:8]}"
    where += f", resumed run saw {list(got.ids or ())[:8]}"
    if at_epoch_boundary and resumed_ids and resumed_ids <= seen_before:
        remedy = (
            "after an end-of-epoch checkpoint the new epoch repeats the previous epoch's"
            " examples: the sampler's epoch (seed) was not advanced on resume; call"
            " sampler.set_epoch(epoch) or checkpoint mid-epoch"
        )
    elif at_epoch_boundary:
        remedy = (
            "after an end-of-epoch checkpoint the next epoch's order differs from the"
            " uninterrupted run's: the loader did not start the new epoch as it would have (a"
            " StatefulDataLoader cut by limit_train_batches resumes inside the old permutation;"
            " a plain DataLoader draws its permutation from another RNG state); checkpoint"
            " mid-epoch with a StatefulDataLoader, or accept the reshuffle"
        )
    elif not loader_stateful:
        remedy = (
            "the DataLoader cannot resume mid-epoch: it starts its order (a permutation, or a"
            " stream) over, so examples"
            f" already trained on come again ({len(replayed)} of those compared here) while"
            " others are never seen; use torchdata's StatefulDataLoader (an end-of-epoch"
            " checkpoint does not help a plain DataLoader: Lightning re-enters the finished epoch"
            " on resume)"
        )
    else:
        remedy = (
            "the loader is stateful but its position was not restored; a known cause is"
            " Lightning issue #20550 (configure_optimizers reads"
            " trainer.estimated_stepping_batches, which drops the loader state): compute the"
            " number of steps yourself, or restore the loader state explicitly"
        )
    return check("fail", f"{where}; {remedy}")


def _value_check(
    name: str,
    what: str,
    first: tuple[int, StepRecord, StepRecord] | None,
    expected: int,
    got: int,
    cause: str = "",
) -> CheckResult:
    if first is None:
        if got < expected:
            return CheckResult(name, "fail", f"only {got} of {expected} micro-batches to compare")
        return CheckResult(name, "pass", f"{expected} micro-batches equal")
    index, ref, resumed = first
    if name == "loss_trajectory":
        values = f"{ref.loss!r} expected, {resumed.loss!r} after resume"
    else:
        values = f"{list(ref.lrs)} expected, {list(resumed.lrs)} after resume"
    return CheckResult(
        name,
        "fail",
        f"{what} first differ at micro-batch {index} (step {ref.step}): {values}{cause}",
    )
