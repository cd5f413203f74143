"""Run configuration identity: canonical parameters, ``config_hash`` and ``variant_key``.

A ledger compares runs by what they were asked to do. Two runs with the same experiment, the
same parameters and the same batch/precision settings are the same *variant*; adding the seed
makes them the same *configuration*. Both identities are hashes of a canonical JSON text, so
they do not depend on the order of dict keys or on the process that computed them.

* :func:`canonical_params_json`: JSON with sorted keys, no spaces, finite numbers only.
* :func:`config_hash`: sha256 (first 16 hex digits) of the experiment, parameters, setup and
  seed: equal for two runs that should give the same result.
* :func:`variant_key`: the same without the seed: equal for the seeds of one variant, and the
  key a relaunch is checked against (a variant that diverged before warns when started again).

Example:
    >>> from lightning_pilot.core.config import canonical_params_json, config_hash, variant_key
    >>> canonical_params_json({"lr": 1e-4, "layers": [2, 2], "name": "ctl"})
    '{"layers":[2,2],"lr":0.0001,"name":"ctl"}'
    >>> one = config_hash("lr-sweep", {"lr": 1e-4}, seed=1)
    >>> one == config_hash("lr-sweep", {"lr": 1e-4}, seed=1)
    True
    >>> one == config_hash("lr-sweep", {"lr": 1e-4}, seed=2)
    False
    >>> variant_key("lr-sweep", {"lr": 1e-4}) == variant_key("lr-sweep", {"lr": 2e-4})
    False
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, Final

from lightning_pilot.core import validate

__all__ = [
    "canonical_params_json",
    "config_hash",
    "environment",
    "git_revision",
    "variant_key",
]

_HASH_DIGITS: Final = 16


def canonical_params_json(params: Mapping[str, Any] | None) -> str:
    """The canonical JSON text of a parameter dict: sorted keys, compact, finite numbers.

    Tuples become lists; numpy/torch scalars become Python numbers. ``1`` and ``1.0`` stay
    different, as they are in JSON.

    Raises:
        TypeError: ``params`` is not a mapping, a key is not a string, or a value is not a
            JSON value (:func:`lightning_pilot.core.validate.mapping_of_scalars`).
        ValueError: a number is NaN or infinite.
    """
    return _json(validate.mapping_of_scalars("canonical_params_json", "params", params))


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _digest(
    experiment: str, params: Mapping[str, Any] | None, setup: Mapping[str, Any] | None, **seed: Any
) -> str:
    plain = {
        "experiment": experiment,
        "params": validate.mapping_of_scalars("canonical_params_json", "params", params),
        "setup": validate.mapping_of_scalars("canonical_params_json", "setup", setup),
    }
    return hashlib.sha256(_json(plain | seed).encode()).hexdigest()[:_HASH_DIGITS]


def variant_key(
    experiment: str, params: Mapping[str, Any] | None, setup: Mapping[str, Any] | None = None
) -> str:
    """Identity of a variant: experiment, parameters and setup, without the seed.

    Args:
        experiment: the experiment name.
        params: the user's parameters (see :func:`canonical_params_json`).
        setup: facts of the training setup that change the experiment (micro-batch size,
            accumulation, data-parallel replicas, precision); ``None`` values are kept, so a
            fact that could not be read never matches a known one.

    Returns:
        16 hex digits.
    """
    return _digest(experiment, params, setup)


def config_hash(
    experiment: str,
    params: Mapping[str, Any] | None,
    seed: int | None,
    setup: Mapping[str, Any] | None = None,
) -> str:
    """Identity of one configuration: :func:`variant_key`'s inputs plus the seed (16 hex)."""
    return _digest(experiment, params, setup, seed=seed)


_SHA: Final = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


def _git_dir(start: Path) -> Path | None:
    for folder in (start, *start.parents):
        candidate = folder / ".git"
        if candidate.is_dir():
            return candidate
        if candidate.is_file():  # a worktree or submodule: "gitdir: <path>"
            text = candidate.read_text(encoding="utf-8", errors="replace").strip()
            if text.startswith("gitdir:"):
                target = Path(text[len("gitdir:") :].strip())
                return target if target.is_absolute() else (folder / target).resolve()
    return None


def git_revision(start: str | os.PathLike[str] | None = None) -> str | None:
    """The commit checked out in the git repository holding ``start`` (default: the cwd).

    Reads ``.git/HEAD`` and the ref it names (loose or packed) directly: no ``git`` process is
    started. Returns ``None`` outside a repository or when the files cannot be read.

    Example:
        >>> import tempfile
        >>> git_revision(tempfile.mkdtemp()) is None
        True
    """
    try:
        git = _git_dir(Path(start or os.getcwd()).resolve())
        if git is None:
            return None
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if _SHA.fullmatch(head):
            return head
        if not head.startswith("ref:"):
            return None
        ref = head[len("ref:") :].strip()
        # A worktree keeps its refs in the common folder.
        common = git / "commondir"
        roots = [git]
        if common.is_file():
            roots.append((git / common.read_text(encoding="utf-8").strip()).resolve())
        for root in roots:
            loose = root / ref
            if loose.is_file():
                value = loose.read_text(encoding="utf-8").strip()
                return value if _SHA.fullmatch(value) else None
            packed = root / "packed-refs"
            if packed.is_file():
                for line in packed.read_text(encoding="utf-8").splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[1] == ref and _SHA.fullmatch(parts[0]):
                        return parts[0]
    except OSError:
        return None
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, str | None]:
    """The software environment a ledger record carries (versions, host, git revision).

    Example:
        >>> sorted(environment())
        ['git_revision', 'hostname', 'lightning_version', 'python_version', 'torch_version']
    """
    return {
        "torch_version": _version("torch"),
        "lightning_version": _version("lightning"),
        "python_version": platform.python_version(),
        "hostname": socket.gethostname() or None,
        "git_revision": git_revision(),
    }
