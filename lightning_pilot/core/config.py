"""Run configuration identity: canonical parameters, ``config_hash``, ``variant_key``, environment
(docs/ledger.md, "Identity, repeats and relaunches")."""

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

_HASH_DIGITS: Final = 16
_SHA: Final = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


def canonical_params_json(params: Mapping[str, Any] | None) -> str:
    """The canonical JSON text of a parameter dict of scalars: sorted keys, compact."""
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
    """Identity of a variant (16 hex digits): experiment, parameters and ``setup`` (the facts
    that change the experiment), not the seed."""
    return _digest(experiment, params, setup)


def config_hash(
    experiment: str,
    params: Mapping[str, Any] | None,
    seed: int | None,
    setup: Mapping[str, Any] | None = None,
) -> str:
    """Identity of one configuration: :func:`variant_key`'s inputs plus the seed (16 hex)."""
    return _digest(experiment, params, setup, seed=seed)


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
    """The commit checked out in the git repository holding ``start`` (default: the cwd), read
    from ``.git``; ``None`` outside a repository or on a read error."""
    try:
        git = _git_dir(Path(start or os.getcwd()).resolve())
        if git is None:
            return None
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if not head.startswith("ref:"):  # a detached HEAD holds the sha itself
            return head if _SHA.fullmatch(head) else None
        ref = head[len("ref:") :].strip()
        roots = [git]
        common = git / "commondir"  # a worktree keeps its refs in the common folder
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
    """The software environment a ledger record carries (versions, host, git revision)."""
    return {
        "torch_version": _version("torch"),
        "lightning_version": _version("lightning"),
        "python_version": platform.python_version(),
        "hostname": socket.gethostname() or None,
        "git_revision": git_revision(),
    }
