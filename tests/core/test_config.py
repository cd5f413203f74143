"""Run configuration identity, without a Trainer: canonical JSON, hashes, environment."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_pilot.core import validate
from lightning_pilot.core.config import (
    canonical_params_json,
    config_hash,
    environment,
    git_revision,
    variant_key,
)


def test_canonical_params_and_hashes() -> None:
    one = canonical_params_json({"b": [1, 2.5], "a": {"y": None, "x": True}})
    assert one == '{"a":{"x":true,"y":null},"b":[1,2.5]}'
    assert canonical_params_json({"a": (1, 2)}) == canonical_params_json({"a": [1, 2]})
    assert canonical_params_json({"n": np.int64(3)}) == '{"n":3}'
    assert canonical_params_json({"x": torch.tensor(0.5), "f": np.float32(2.0)}) == (
        '{"f":2.0,"x":0.5}'
    )
    assert canonical_params_json({"i": 1}) != canonical_params_json({"i": 1.0})
    assert canonical_params_json(None) == "{}"
    setup = {"micro_batch_size": 8, "accumulate_grad_batches": 2}
    key = variant_key("exp", {"lr": 1e-4}, setup)
    assert len(key) == 16
    assert key == variant_key("exp", {"lr": 0.0001}, dict(reversed(setup.items())))
    assert key != variant_key("exp", {"lr": 1e-4}, setup | {"micro_batch_size": 4})
    assert key != variant_key("exp", {"lr": 1e-4}, setup | {"micro_batch_size": None})
    assert key != variant_key("other", {"lr": 1e-4}, setup)
    assert config_hash("exp", {"lr": 1e-4}, 0, setup) != config_hash("exp", {"lr": 1e-4}, 1, setup)
    assert config_hash("exp", {"lr": 1e-4}, 0, setup) != key


def test_hashes_are_stable_across_releases() -> None:
    # Ledgers written by earlier versions are matched against these: the text must not move.
    assert variant_key("lr-sweep", {"lr": 1e-4}) == "a1c307876c73d551"
    assert config_hash("lr-sweep", {"lr": 1e-4}, 1) == "749e509d14f8a189"


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        (
            [1, 2],
            TypeError,
            r"canonical_params_json\(params=\[1, 2\]\) is invalid: expected a dict",
        ),
        ({"lr": float("nan")}, ValueError, r"params\['lr'\]=nan is not finite"),
        ({"lr": [float("inf")]}, ValueError, r"params\['lr'\]\[0\]=inf is not finite"),
        ({"a": {1: 2}}, TypeError, r"params\['a'\] has the key 1"),
        ({"f": print}, TypeError, r"params\['f'\] is a builtin_function_or_method, not a JSON"),
        ({"t": torch.ones(2)}, TypeError, r"params\['t'\] is a Tensor, not a JSON value"),
    ],
)
def test_bad_params(params: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        canonical_params_json(params)


def test_the_ledger_checks_params_as_canonical_json_does() -> None:
    # One check serves both: a value the ledger accepts always has a canonical text.
    params = {"lr": np.float64(0.1), "pair": (1, 2)}
    plain = validate.mapping_of_scalars("DivergenceLedger", "params", params)
    assert canonical_params_json(plain) == canonical_params_json(params)


def test_git_revision_reads_head_without_git(tmp_path: Path) -> None:
    assert git_revision(tmp_path) is None
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert git_revision(tmp_path) is None  # no commit yet: HEAD names a missing ref
    (tmp_path / "f").write_text("x")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}  # fmt: skip
    subprocess.run(["git", "-C", str(tmp_path), "add", "f"], check=True, env=env)
    subprocess.run(["git", "-C", str(tmp_path), "commit", "-qm", "c"], check=True, env=env)
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (tmp_path / "sub").mkdir()
    assert git_revision(tmp_path / "sub") == head  # found from a folder inside the repository
    subprocess.run(["git", "-C", str(tmp_path), "pack-refs", "--all"], check=True, env=env)
    assert git_revision(tmp_path) == head  # from packed-refs
    subprocess.run(["git", "-C", str(tmp_path), "checkout", "-q", head], check=True, env=env)
    assert git_revision(tmp_path) == head  # a detached HEAD holds the sha itself


def test_environment_names_the_software() -> None:
    env = environment()
    assert env["torch_version"] == metadata.version("torch")
    assert env["lightning_version"] == metadata.version("lightning")
    assert env["python_version"] == platform.python_version()
