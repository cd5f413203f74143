"""lightning_pilot.core.validate: one error format, strict types, finite numbers, strict sizes."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from lightning_pilot.core import validate


class BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_the_one_message_format() -> None:
    with pytest.raises(TypeError) as caught:
        validate.integer("Owner", "steps", "3", minimum=1)
    assert str(caught.value) == "Owner(steps='3') is invalid: expected an integer >= 1, got str."
    with pytest.raises(ValueError, match="steps=0") as wrong:
        validate.integer("Owner", "steps", 0, minimum=1, optional=True, hint="updates")
    assert str(wrong.value) == (
        "Owner(steps=0) is invalid: expected an integer >= 1 or None (updates)."
    )


def test_long_and_broken_reprs_are_shown_short() -> None:
    with pytest.raises(ValueError, match=r"^Owner\(n=<int object>\) is invalid") as caught:
        validate.integer("Owner", "n", 10**5000)  # repr() itself refuses 5000 digits
    assert len(str(caught.value)) < 200
    assert "64 bits" in str(caught.value)
    with pytest.raises(TypeError, match=r"Owner\(n=<BrokenRepr object>\) is invalid"):
        validate.integer("Owner", "n", BrokenRepr())


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, "1", None, Fraction(1)])
def test_integers_are_not_bools_floats_or_text(value: object) -> None:
    with pytest.raises(TypeError, match=r"Owner\(n=.*\) is invalid: expected an integer"):
        validate.integer("Owner", "n", value)


def test_integers_accept_numpy_and_return_int() -> None:
    value = validate.integer("Owner", "n", np.int64(7), minimum=1)
    assert (value, type(value)) == (7, int)
    assert validate.integer("Owner", "n", None, optional=True) is None
    assert validate.integer("Owner", "n", validate.INT64_MIN) == -(2**63)
    with pytest.raises(ValueError, match="64 bits"):
        validate.integer("Owner", "n", validate.INT64_MAX + 1)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-float("inf"), ValueError),
        (1e308 * 10, ValueError),
        (10**400, ValueError),
        (-(10**400), ValueError),
        (np.float32("nan"), ValueError),
        (True, TypeError),
        ("1.0", TypeError),
        (1j, TypeError),
        (None, TypeError),
    ],
)
def test_numbers_are_finite_reals(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"Owner\(x=.*\) is invalid: expected a finite number"):
        validate.number("Owner", "x", value)


def test_number_bounds() -> None:
    assert validate.number("O", "x", 0, minimum=0) == 0.0
    assert validate.number("O", "x", 1, minimum=0, maximum=1, allow_minimum=False) == 1.0
    assert validate.number("O", "x", Fraction(1, 2)) == 0.5
    assert validate.number("O", "x", None, optional=True) is None
    with pytest.raises(ValueError, match=r"expected a finite number > 0\."):
        validate.number("O", "x", 0, minimum=0, allow_minimum=False)
    with pytest.raises(ValueError, match=r"expected a finite number from 0 to 1\."):
        validate.number("O", "x", 1.5, minimum=0, maximum=1)
    assert validate.number("O", "x", float("inf"), finite=False) == float("inf")


@pytest.mark.parametrize("value", ["no", "False", "", 0, 1, None, np.bool_(False)])
def test_booleans_are_only_true_or_false(value: object) -> None:
    with pytest.raises(TypeError, match=r"expected True or False, got"):
        validate.boolean("Owner", "flag", value)


def test_choice() -> None:
    assert validate.choice("O", "mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"O\(mode='A'\) is invalid: expected one of 'a', 'b'"):
        validate.choice("O", "mode", "A", ("a", "b"))
    with pytest.raises(TypeError, match=r"O\(mode=None\) is invalid: expected one of"):
        validate.choice("O", "mode", None, ("a", "b"))


def test_text_name_path_strings_instance_and_callable() -> None:
    assert validate.text("O", "key", "preds") == "preds"
    with pytest.raises(ValueError, match=r"O\(key='  '\) is invalid: expected a non-empty"):
        validate.text("O", "key", "  ")
    with pytest.raises(ValueError, match=r"expected 1 to 200 printable characters"):
        validate.run_name("O", "variant", "a\tb")
    with pytest.raises(TypeError, match=r"O\(variant=None\) is invalid: expected a string"):
        validate.run_name("O", "variant", None)
    with pytest.raises(ValueError, match=r"O\(out_dir='a\\x00b'\) is invalid"):
        validate.path("O", "out_dir", "a\x00b")
    with pytest.raises(TypeError, match=r"O\(out_dir=3\) is invalid"):
        validate.path("O", "out_dir", 3)
    assert validate.strings("O", "names", ["a", "b"]) == ("a", "b")
    with pytest.raises(TypeError, match=r"O\(names='ab'\) is invalid: expected a list"):
        validate.strings("O", "names", "ab")
    with pytest.raises(TypeError, match=r"O\(rules='x'\) is invalid: expected an int or None"):
        validate.instance("O", "rules", "x", int)
    with pytest.raises(TypeError, match=r"O\(fn=3\) is invalid: expected a callable or None"):
        validate.callable_or_none("O", "fn", 3)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ([1, 2], TypeError, r"params=\[1, 2\]\) is invalid: expected a dict of str -> scalar"),
        ({1: 2}, TypeError, r"params has the key 1"),
        ({"a": {"b": float("nan")}}, ValueError, r"params\['a'\]\['b'\]=nan is not finite"),
        ({"a": [1, object()]}, TypeError, r"params\['a'\]\[1\] is a object, not a JSON value"),
    ],
)
def test_mapping_of_scalars_refuses(value: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        validate.mapping_of_scalars("DivergenceLedger", "params", value)


def test_mapping_of_scalars_gives_plain_json_values() -> None:
    given = {"lr": np.float64(0.5), "n": np.int64(3), "shape": (2, 2), "x": None, "ok": True}
    plain = validate.mapping_of_scalars("O", "params", given)
    assert plain == {"lr": 0.5, "n": 3, "shape": [2, 2], "x": None, "ok": True}
    assert (type(plain["lr"]), type(plain["n"])) == (float, int)
    assert validate.mapping_of_scalars("O", "params", None) == {}


# -- sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 1024**3),
        ("80GB", 80 * 1000**3),
        ("141G", 141 * 1024**3),
        ("24000MiB", 24000 * 1024**2),
        ("24000mib", 24000 * 1024**2),
        (" 1.5 TiB ", int(1.5 * 1024**4)),
        ("512", 512),
        ("512B", 512),
        ("64KB", 64_000),
        ("0.1KiB", 102),  # 102.4 bytes, rounded
        ("1.1TB", 1_100_000_000_000),  # exact: no float rounding
        ("0000012G", 12 * 1024**3),
        ("8388607TiB", 8388607 * 1024**4),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert validate.parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "GiB",
        "80 parsecs",
        "-1GiB",
        "0GiB",
        "8 0GB",
        "80GiBs",
        "١٢G",  # Arabic-Indic digits: not 12 GiB
        "１２G",  # fullwidth digits
        "12\u00a0G",  # a no-break space
        "12G\n",
        "0.4",  # under one byte
        "inf",
        "nan",
        "1e3",
        ".5G",
        "1." + "0" * 31,
    ],
)
def test_parse_size_accepts_only_ascii_sizes(text: str) -> None:
    with pytest.raises(ValueError, match=rf"^gpu_memory={re.escape(repr(text))} is not a size"):
        validate.parse_size(text, "gpu_memory")


@pytest.mark.parametrize("text", ["9" * 400, "8388608TiB", "9" * 5000 + "G"])
def test_parse_size_refuses_more_than_8_eib(text: str) -> None:
    with pytest.raises(ValueError, match=r"^gpu_memory=.* is too large: at most"):
        validate.parse_size(text, "gpu_memory")
    assert validate.parse_size("8388607.999TiB") <= validate.INT64_MAX


def test_parse_size_refuses_a_non_string() -> None:
    with pytest.raises(TypeError, match=r"^size=80 is not a size: expected a string"):
        validate.parse_size(80)
