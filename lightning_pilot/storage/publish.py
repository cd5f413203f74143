"""Atomic publication of bytes, JSON and Parquet under a new name, never overwriting one, and
the disk reserve (docs/architecture.md, "Storage rules"; docs/storage.md, "What each backend
guarantees")."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import sys
import threading
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Final, overload

import pyarrow as pa
import pyarrow.parquet as pq

from lightning_pilot.storage.paths import Location, PathLike, RemotePath, location

#: Protocols whose ``open(path, "xb")`` refuses an existing name in the same request that
#: creates it: S3 (s3fs sends ``If-None-Match: *``; refused with 412) and the in-process
#: ``memory://`` (checked and created under one lock). Others: checked, then written
#: (docs/storage.md, "What each backend guarantees").
EXCLUSIVE_CREATE_PROTOCOLS: Final = frozenset({"s3", "s3a", "memory"})
_MEMORY_LOCK = threading.Lock()
_WARNED_NOT_EXCLUSIVE: set[str] = set()


def _fsync_dir(folder: Path) -> None:
    """Make a new name in ``folder`` durable (where folders can be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _immutable(final: Location) -> FileExistsError:
    return FileExistsError(f"refusing to overwrite {final}: published files are immutable")


def _publish_no_overwrite(tmp: Path, final: Path) -> None:
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise _immutable(final) from None
    except OSError as err:  # no hard links here: a checked rename (the only window to overwrite)
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        if final.exists():
            raise _immutable(final) from None
        os.rename(tmp, final)


@overload
def publish_file(
    path: RemotePath, write: Callable[[BinaryIO], object], *, replace: bool = False
) -> RemotePath: ...
@overload
def publish_file(
    path: os.PathLike[str], write: Callable[[BinaryIO], object], *, replace: bool = False
) -> Path: ...
@overload
def publish_file(
    path: PathLike, write: Callable[[BinaryIO], object], *, replace: bool = False
) -> Location: ...
def publish_file(
    path: PathLike, write: Callable[[BinaryIO], object], *, replace: bool = False
) -> Location:
    """Write a file atomically under ``path`` with ``write(handle)``, never overwriting.

    A hidden temporary file in the same folder is fsynced, then hard-linked (which refuses an
    existing name); on any error it is removed and the error propagates. A hidden name (``.``
    or ``_``: readers skip it) is a ``ValueError``. ``replace=True`` (a plot drawn again)
    replaces an older file atomically. On a :class:`RemotePath` the bytes are created in one
    request that refuses an existing name where the backend can
    (:data:`EXCLUSIVE_CREATE_PROTOCOLS`).
    """
    final = location(path)
    if final.name.startswith((".", "_")):
        raise ValueError(
            f"path={str(final)!r} names a hidden file; readers skip names starting with"
            " '.' or '_', so it would never be read."
        )
    if isinstance(final, RemotePath):
        return _publish_remote(final, write, replace=replace)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not replace:
        raise _immutable(final)
    tmp = final.parent / f".{final.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if replace:
            os.replace(tmp, final)
        else:
            _publish_no_overwrite(tmp, final)
    except BaseException as err:  # a failed clean-up is only noted on the first error
        problem = _remove_temporary(tmp)
        if problem is not None:
            note = f"lightning-pilot: could not remove the temporary file {tmp}: {problem}"
            if sys.version_info >= (3, 11):
                err.add_note(note)
            else:  # pragma: no cover - Python 3.10 has no exception notes
                warnings.warn(note, RuntimeWarning, stacklevel=2)
        raise
    problem = _remove_temporary(tmp)
    if problem is not None:  # published: the hidden temporary file is invisible to readers
        warnings.warn(
            f"lightning-pilot: published {final} but could not remove the temporary file"
            f" {tmp}: {problem}",
            RuntimeWarning,
            stacklevel=2,
        )
    _fsync_dir(final.parent)
    return final


def _publish_remote(
    final: RemotePath, write: Callable[[BinaryIO], object], *, replace: bool
) -> RemotePath:
    """Publish on an fsspec filesystem: the whole file in one create."""
    buffer = io.BytesIO()
    write(buffer)
    data = buffer.getvalue()
    fs, path = final.fs, final.path
    fs.makedirs(final.parent.path, exist_ok=True)
    if replace:
        fs.pipe_file(path, data)
    elif final.protocol == "memory":
        with _MEMORY_LOCK:  # one process: the check and the create under one lock
            if fs.exists(path):
                raise _immutable(final)
            fs.pipe_file(path, data)
    elif final.protocol in EXCLUSIVE_CREATE_PROTOCOLS:
        try:
            with fs.open(path, "xb") as handle:
                handle.write(data)
        except FileExistsError:
            raise _immutable(final) from None
    else:
        if final.protocol not in _WARNED_NOT_EXCLUSIVE:
            _WARNED_NOT_EXCLUSIVE.add(final.protocol)
            warnings.warn(
                f"lightning-pilot: {final.protocol}:// has no create-if-absent here; files are"
                " checked, then written (two writers of one name at the same instant could"
                " overwrite; pilot file names are unique per writer). See docs/storage.md.",
                RuntimeWarning,
                stacklevel=3,
            )
        if final.exists():
            raise _immutable(final)
        fs.pipe_file(path, data)
    final._fresh()
    return final


def _remove_temporary(tmp: Path) -> OSError | None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError as err:
        return err
    return None


def publish_table(table: pa.Table, path: PathLike) -> Location:
    """Write ``table`` as Parquet to ``path`` atomically, never overwriting (``publish_file``)."""
    return publish_file(path, lambda handle: pq.write_table(table, handle))


@overload
def publish_bytes(data: bytes, path: RemotePath) -> RemotePath: ...
@overload
def publish_bytes(data: bytes, path: os.PathLike[str]) -> Path: ...
@overload
def publish_bytes(data: bytes, path: PathLike) -> Location: ...
def publish_bytes(data: bytes, path: PathLike) -> Location:
    """Write ``data`` to ``path`` atomically, never overwriting (:func:`publish_file`)."""
    return publish_file(path, lambda handle: handle.write(data))


def publish_json(value: Any, path: PathLike) -> Location:
    """Write ``value`` as JSON to ``path`` atomically, never overwriting (:func:`publish_file`).

    Example:
        >>> import tempfile
        >>> path = publish_json({"ok": True}, f"{tempfile.mkdtemp()}/result.json")
        >>> read_json(path, max_bytes=1024)
        {'ok': True}
    """
    return publish_bytes(json.dumps(value, allow_nan=False).encode(), path)


def read_json(path: PathLike, *, max_bytes: int) -> Any:
    """Read a JSON file written by :func:`publish_json`; ``ValueError`` if over ``max_bytes``."""
    with location(path).open("rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path} is larger than {max_bytes} bytes: not a file this pilot wrote")
    try:
        return json.loads(data)
    except RecursionError as err:  # nested deeper than the parser's stack
        raise ValueError(f"{path} is nested too deeply: not a file this pilot wrote") from err


def reserve_file(path: PathLike, size: int) -> bool:
    """Hold ``size`` bytes of disk in a new hidden file ``path``; ``False`` when that cannot be
    done (no room, the file exists, or no ``posix_fallocate``: not Linux)."""
    target = location(path)
    if isinstance(target, RemotePath):
        return False  # no disk of ours to hold on an object store
    with contextlib.suppress(OSError, AttributeError):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            return True
        finally:
            os.close(fd)
    return False
