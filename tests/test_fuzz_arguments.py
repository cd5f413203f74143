"""Every public constructor and function refuses a bad argument at once, naming it.

One argument at a time gets a bad value (wrong type, NaN/inf, negative, zero, huge, empty,
unknown); the call must raise exactly ``TypeError`` (wrong type) or ``ValueError`` (wrong
value) while constructing, before any fit, with the message ``Owner(name=...) is invalid: ...``.

The cases come from each callable's signature: every parameter must have a kind in
:data:`KINDS` (a new argument without one fails :func:`test_every_argument_has_a_kind`), and
each kind lists its bad values with the error type expected, written out. Some valid edge
values are checked to be accepted. No fit runs: the whole file takes about a second.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_pilot import (
    BatchAdapter,
    BatchInspector,
    DivergenceLedger,
    EffectiveBatchAccountant,
    Heartbeat,
    OverfitTinySubset,
    PhaseMemoryMonitor,
    ResumeVerifier,
    ValidationPredictionWriter,
)
from lightning_pilot.core.ids import new_run_id
from lightning_pilot.core.update_plan import plan_updates
from lightning_pilot.pilot import PILOT_OPTION_KEYS, pilot_callbacks

HUGE_INT = 10**400  # beyond int64 and beyond float
HUGE_FLOAT = 1e308 * 10  # overflows to inf
NAN, INF = float("nan"), float("inf")


# -- kinds of argument and their bad values ------------------------------------------------------


@dataclass(frozen=True)
class Int:
    minimum: int | None = None
    maximum: int | None = None


@dataclass(frozen=True)
class Float:
    minimum: float | None = None
    maximum: float | None = None
    open_minimum: bool = False  # minimum itself is refused


@dataclass(frozen=True)
class Choice:
    options: tuple[str, ...]


@dataclass(frozen=True)
class Kind:
    """A kind without parameters, named."""

    name: str


BOOL, FUNC, TEXT, NAME, PATH = Kind("bool"), Kind("func"), Kind("text"), Kind("name"), Kind("path")
OPTIONAL_BOOL = Kind("optional bool")  # True, False or None (None: decided from the module)
INSTANCE, PARAMS, STRINGS = Kind("instance"), Kind("params"), Kind("strings")
SPEC, FACTORY, RUN_ID, SCHEDULE = Kind("spec"), Kind("factory"), Kind("run_id"), Kind("schedule")
OPTION, OVERFIT = Kind("option"), Kind("overfit")
TOKENS = Kind("tokens")

Bad = tuple[object, type[Exception]]


def _int_values(kind: Int) -> Iterator[Bad]:
    yield from [("3", TypeError), (3.0, TypeError), (True, TypeError), ([], TypeError)]
    yield from [(NAN, TypeError), (HUGE_INT, ValueError), (-HUGE_INT, ValueError)]
    if kind.minimum is not None:
        yield kind.minimum - 1, ValueError
        if kind.minimum > -1:
            yield -1, ValueError
        if kind.minimum > 0:
            yield 0, ValueError
    if kind.maximum is not None:
        yield kind.maximum + 1, ValueError


def _float_values(kind: Float) -> Iterator[Bad]:
    yield from [("1", TypeError), (True, TypeError), ([], TypeError), (1j, TypeError)]
    yield from [(NAN, ValueError), (INF, ValueError), (-INF, ValueError)]
    yield from [(HUGE_FLOAT, ValueError), (HUGE_INT, ValueError), (-HUGE_INT, ValueError)]
    if kind.minimum is not None:
        yield kind.minimum - 1, ValueError
        if kind.open_minimum:
            yield kind.minimum, ValueError
        if kind.minimum >= 0:
            yield -1e-9, ValueError
    if kind.maximum is not None:
        yield kind.maximum + 1e-9, ValueError


_VALUES: dict[Kind, list[Bad]] = {
    BOOL: [("no", TypeError), ("False", TypeError), ("", TypeError), (1, TypeError),
           (0, TypeError), (None, TypeError)],
    OPTIONAL_BOOL: [("no", TypeError), ("False", TypeError), ("", TypeError), (1, TypeError),
                    (0, TypeError)],
    FUNC: [("fn", TypeError), (3, TypeError), ([], TypeError)],
    TEXT: [(3, TypeError), (b"x", TypeError), ("", ValueError), ("   ", ValueError)],
    NAME: [(3, TypeError), (None, TypeError), ("", ValueError), (" ", ValueError),
           ("a\nb", ValueError), ("x" * 201, ValueError)],
    PATH: [(3, TypeError), (b"dir", TypeError), ("", ValueError), (" ", ValueError),
           ("a\x00b", ValueError)],
    INSTANCE: [("ids", TypeError), ({}, TypeError), (3, TypeError)],
    PARAMS: [([1, 2], TypeError), ("lr=1", TypeError), ({1: 2}, TypeError),
             ({"f": print}, TypeError), ({"a": {1: 2}}, TypeError), ({"lr": NAN}, ValueError),
             ({"lr": [INF]}, ValueError), ({"lr": HUGE_FLOAT}, ValueError)],
    STRINGS: [("val_loss", TypeError), ([3], TypeError), (3, TypeError), ({"val": 1}, TypeError),
              ([""], ValueError), (["val", " "], ValueError)],
    SPEC: [(1.5, TypeError), (True, TypeError), ([], TypeError), (b"k", TypeError),
           ("", ValueError), (HUGE_INT, ValueError)],
    FACTORY: [(3, TypeError), (b"a:b", TypeError), ("", ValueError),
              ("module.function", ValueError), ("pkg.mod:", ValueError), (":fn", ValueError),
              ("a b:c", ValueError)],
    RUN_ID: [(3, TypeError), ("", ValueError), ("../x", ValueError), ("run-1", ValueError)],
    SCHEDULE: [("8", TypeError), (8.0, TypeError), (True, TypeError), (None, TypeError),
               ([8], TypeError), ({"0": 2}, TypeError), ({0: "2"}, TypeError),
               ({0: True}, TypeError), (0, ValueError), (-1, ValueError),
               (HUGE_INT, ValueError), ({}, ValueError), ({-1: 2}, ValueError),
               ({0: 0}, ValueError), ({0: HUGE_INT}, ValueError)],
    OPTION: [(3, TypeError), ("yes", TypeError), ([], TypeError), (1.0, TypeError),
             ({"no_such_option": 1}, ValueError), ({"out_dir": "x"}, ValueError)],
    OVERFIT: [(True, ValueError), ({}, ValueError), ({"max_steps": 30}, ValueError)],
    TOKENS: [("### Response:", TypeError), (b"x", TypeError), (3, TypeError), ([], ValueError),
             ([-1], ValueError), ([True], TypeError), ([1.5], TypeError),
             ([HUGE_INT], ValueError)],
}  # fmt: skip


def bad_values(kind: object, optional: bool) -> list[Bad]:
    """The bad values of one argument, each with the error it must raise."""
    if isinstance(kind, Int):
        values = list(_int_values(kind))
    elif isinstance(kind, Float):
        values = list(_float_values(kind))
    elif isinstance(kind, Choice):
        values = [(3, TypeError), (["x"], TypeError), ("", ValueError), ("unknown", ValueError),
                  (kind.options[0].upper(), ValueError)]  # fmt: skip
    else:
        assert isinstance(kind, Kind)
        values = list(_VALUES[kind])
    if not optional and (None, TypeError) not in values:
        values.append((None, TypeError))
    return values


# -- the callables and the kind of each of their arguments ---------------------------------------

Target = Callable[..., Any]

#: Arguments a call cannot go without (the bad one replaces its entry).
BASE: dict[Target, dict[str, Any]] = {
    DivergenceLedger: {"experiment": "e", "variant": "v"},
    plan_updates: {"dataset_size": 100, "micro_batch_size": 2, "epochs": 1},
}

KINDS: dict[Target, dict[str, object]] = {
    PhaseMemoryMonitor: {
        "pilot_updates": Int(2),
        "sample_every": Int(0),
        "memory_updates": Int(1, 3),  # at most pilot_updates (3 by default)
        "export": FUNC,
        "on_fail": Choice(("record", "raise")),
        "track_cpu": BOOL,
        "adapter": INSTANCE,
        "out_dir": PATH,
    },
    BatchInspector: {
        "batches": Int(1),
        "examples": Int(0),
        "decode": FUNC,
        "group_fn": FUNC,
        "max_examples": Int(1),
        "num_classes": Int(2),
        "vocab_size": Int(2),
        "max_length": Int(1),
        "pad_token_id": Int(0),
        "padding_warn": Float(0, 1),
        "response_mask_key": TEXT,
        "prompt_length_key": TEXT,
        "response_template": TOKENS,
        "adapter": INSTANCE,
        "out_dir": PATH,
    },
    EffectiveBatchAccountant: {
        "keep": Choice(("updates", "examples", "epochs")),
        "adapter": INSTANCE,
        "token_spread_ratio": Float(1),
        "out_dir": PATH,
    },
    ResumeVerifier: {
        "at_step": Int(1),
        "compare_steps": Int(1),
        "factory": FACTORY,
        "fallback": Choice(("none", "in_process")),
        "atol": Float(0),
        "rtol": Float(0),
        "epoch_boundary": BOOL,
        "check_artifact": BOOL,
        "export": FUNC,
        "control_batches": Int(1),
        "timeout_s": Float(0, open_minimum=True),
        "adapter": INSTANCE,
        "out_dir": PATH,
    },
    DivergenceLedger: {
        "experiment": NAME,
        "variant": NAME,
        "seed": Int(0),
        "params": PARAMS,
        "derived_from": RUN_ID,
        "rules": INSTANCE,
        "action": Choice(("stop", "record")),
        "check_every": Int(1),
        "grad_norm_every": Int(1),
        "heartbeat": INSTANCE,
        "on_repeat": Choice(("warn", "error", "ignore")),
        "val_metrics": STRINGS,
        "out_dir": PATH,
    },
    Heartbeat: {"seconds": Float(0), "updates": Int(1)},
    ValidationPredictionWriter: {
        "predictions_fn": FUNC,
        "predictions_key": TEXT,
        "adapter": INSTANCE,
        "out_dir": PATH,
    },
    OverfitTinySubset: {
        "num_examples": Int(1),
        "seed": Int(0),
        "max_steps": Int(1),
        "target_loss": Float(0, open_minimum=True),
        "target_fraction": Float(0, 1, open_minimum=True),
        "required_recovery": Float(0, 1, open_minimum=True),
        "check_every": Int(1),
        "batch_size": Int(1),
        "num_classes": Int(2),
        "shift_labels": OPTIONAL_BOOL,
        "init_tolerance": Float(1, open_minimum=True),
        "predict_fn": FUNC,
        "adapter": INSTANCE,
        "out_dir": PATH,
    },
    BatchAdapter: {
        "ids": SPEC,
        "inputs": SPEC,
        "targets": SPEC,
        "attention_mask": SPEC,
        "decoder_inputs": SPEC,
        "ignore_index": Int(),
    },
    pilot_callbacks: {
        "out_dir": PATH,
        "experiment": NAME,
        "variant": NAME,
        "seed": Int(0),
        "adapter": INSTANCE,
        **dict.fromkeys(PILOT_OPTION_KEYS, OPTION),
        "overfit": OVERFIT,
    },
    plan_updates: {
        "dataset_size": Int(1),
        "micro_batch_size": Int(1),
        "accumulate_grad_batches": SCHEDULE,
        "dp_replicas": Int(1),
        "epochs": Int(1),
        "max_steps": Int(0),
        "drop_last": BOOL,
        "replica_split": Choice(("pad", "drop")),
        "limit_micro_batches": Int(0),
    },
}


def _owner(target: Target) -> str:
    return str(target.__name__)


def _parameters(target: Target) -> dict[str, inspect.Parameter]:
    """The arguments a user passes, from the signature (``**options`` expanded to its keys)."""
    found: dict[str, inspect.Parameter] = {}
    for name, parameter in inspect.signature(target).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            for key in (*PILOT_OPTION_KEYS, "overfit"):
                found[key] = parameter.replace(name=key, kind=inspect.Parameter.KEYWORD_ONLY)
        else:
            found[name] = parameter
    return found


def _cases() -> Iterator[Any]:
    for target, kinds in KINDS.items():
        for name, parameter in _parameters(target).items():
            optional = parameter.default is None or name in PILOT_OPTION_KEYS or name == "overfit"
            for value, error in bad_values(kinds[name], optional):
                label = f"{_owner(target)}-{name}-{error.__name__}-{_label(value)}"
                yield pytest.param(target, name, value, error, id=label)


def _label(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 20 else f"{text[:8]}...{text[-5:]}"


@pytest.mark.parametrize("target", list(KINDS), ids=_owner)
def test_every_argument_has_a_kind(target: Target) -> None:
    assert set(_parameters(target)) == set(KINDS[target])


@pytest.mark.parametrize(("target", "name", "value", "error"), list(_cases()))
def test_a_bad_argument_is_refused_and_named(
    target: Target, name: str, value: object, error: type[Exception]
) -> None:
    arguments = dict(BASE.get(target, {}))
    arguments[name] = value
    with pytest.raises((TypeError, ValueError)) as caught:
        target(**arguments)
    message = str(caught.value)
    assert type(caught.value) is error, message
    owner = _owner(target)
    assert re.match(rf"{re.escape(owner)}\({re.escape(name)}[=\[ ]", message), message
    assert " is invalid: " in message, message


def test_both_output_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"num_classes=4, vocab_size=4\) is invalid"):
        BatchInspector(num_classes=4, vocab_size=4)


def test_neither_epochs_nor_max_steps_is_refused() -> None:
    with pytest.raises(ValueError, match=r"plan_updates\(epochs=None, max_steps=None\)"):
        plan_updates(100, 2)


# -- valid edge values ---------------------------------------------------------------------------

VALID: list[tuple[Target, dict[str, Any]]] = [
    (PhaseMemoryMonitor, {"pilot_updates": 2, "memory_updates": 2, "sample_every": 0}),
    (PhaseMemoryMonitor, {"memory_updates": 1, "track_cpu": False, "out_dir": Path("pilot")}),
    (BatchInspector, {"examples": 0, "padding_warn": 0, "num_classes": 2, "pad_token_id": 0}),
    (BatchInspector, {"padding_warn": 1.0, "vocab_size": 2, "max_length": 1}),
    (BatchInspector, {"batches": np.int64(3), "padding_warn": np.float32(0.25)}),
    (EffectiveBatchAccountant, {"token_spread_ratio": 1, "keep": "epochs"}),
    (EffectiveBatchAccountant, {"token_spread_ratio": 1e300}),
    (ResumeVerifier, {"atol": 0, "rtol": 0.0, "timeout_s": 1e-3, "epoch_boundary": False}),
    (ResumeVerifier, {"factory": "pkg.mod:build", "timeout_s": 1e300}),
    (ResumeVerifier, {"factory": "pkg.mod:Factory.build", "check_artifact": False}),
    (DivergenceLedger, {"seed": 0, "heartbeat": Heartbeat(seconds=0, updates=1)}),
    (DivergenceLedger, {"params": {}, "val_metrics": [], "seed": 2**63 - 1}),
    (DivergenceLedger, {"params": {"lr": np.float64(0.1), "layers": [2, 2], "pair": (1, 2)}}),
    (DivergenceLedger, {"val_metrics": ("val_loss",), "derived_from": new_run_id()}),
    (DivergenceLedger, {"val_metrics": {"val_loss", "val_acc"}}),
    (Heartbeat, {"seconds": np.float32(0.5), "updates": None}),
    (ValidationPredictionWriter, {"predictions_key": "logits", "adapter": BatchAdapter()}),
    (OverfitTinySubset, {"target_fraction": 1, "required_recovery": 1.0, "seed": 0}),
    (OverfitTinySubset, {"init_tolerance": 1.0001, "target_loss": 1e-12, "batch_size": 1}),
    (BatchAdapter, {"ids": 0, "inputs": -1, "ignore_index": 0, "targets": "labels"}),
    (BatchAdapter, {"attention_mask": len, "ignore_index": -(2**63)}),
    (pilot_callbacks, {"overfit": False, "seed": 0, "experiment": "e", "ledger": True}),
    (pilot_callbacks, {"phase_memory": False, "resume": {}, "adapter": BatchAdapter()}),
    (plan_updates, {"dataset_size": 1, "micro_batch_size": 1, "max_steps": 0}),
    (plan_updates, {"dataset_size": np.int64(100), "micro_batch_size": 3, "epochs": 1,
                    "limit_micro_batches": 0, "accumulate_grad_batches": {0: 1, 2: 4}}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("target", "arguments"), VALID, ids=[f"{_owner(t)}-{i}" for i, (t, _) in enumerate(VALID)]
)
def test_valid_edge_values_are_accepted(target: Target, arguments: dict[str, Any]) -> None:
    target(**(BASE.get(target, {}) | arguments))


def test_accepted_numbers_become_plain_python_numbers() -> None:
    inspector = BatchInspector(batches=np.int64(3), padding_warn=np.float32(0.25))
    assert (type(inspector.batches), type(inspector.padding_warn)) == (int, float)
    plan = plan_updates(np.int64(100), np.int64(3), epochs=np.int64(1))
    assert type(plan.dataset_size) is int
    assert plan.total_updates == 34
    ledger = DivergenceLedger(experiment="e", variant="v", params={"lr": np.float64(0.5)})
    assert type(ledger.params["lr"]) is float
