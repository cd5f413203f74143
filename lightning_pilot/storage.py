"""Every file lightning-pilot writes and reads: atomic publish, snapshots, tolerant readers
(docs/architecture.md, "Output folder", "Storage rules"; docs/ledger.md, "What the readers
refuse")."""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import io
import json
import os
import posixpath
import re
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Final, NamedTuple, TypeAlias, overload

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq

from lightning_pilot.core import validate
from lightning_pilot.core.ids import new_run_id, validate_run_id
from lightning_pilot.core.phases import COUNTERS, PHASES, VERDICTS
from lightning_pilot.schemas import (
    LEDGER_EVENTS,
    LEDGER_SCHEMA,
    LEDGER_SCHEMA_VERSION,
    PHASE_SCHEMA,
    PHASE_SCHEMA_VERSION,
    STATUSES,
)

__all__ = [
    "DETAIL_FILE_LIMITS",
    "LEDGER_RECORD_LIMITS",
    "LEDGER_SCHEMA",
    "LEDGER_SCHEMA_VERSION",
    "LEDGER_SEGMENT_LIMITS",
    "PHASE_FILE_LIMITS",
    "PHASE_SCHEMA",
    "PHASE_SCHEMA_VERSION",
    "STATUSES",
    "Location",
    "ReadLimits",
    "RemotePath",
    "SkippedFileWarning",
    "UnsafePathError",
    "compact_ledger",
    "conform",
    "index_ledger",
    "is_remote",
    "list_snapshot_files",
    "location",
    "make_folder",
    "publish_bytes",
    "publish_file",
    "publish_json",
    "publish_table",
    "read_json",
    "read_ledger_records",
    "read_ledger_table",
    "read_parquet_files",
    "read_phase_table",
    "read_snapshot_table",
    "remove_work_folder",
    "rows_to_table",
    "run_folders",
    "safe_join",
    "safe_path_component",
    "sanitize_name",
    "validate_phase_row",
    "work_folder",
    "write_ledger_record",
    "write_snapshot",
]

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fsspec import AbstractFileSystem  # type: ignore[import-untyped]

#: A local path (``str`` or ``os.PathLike``) or a :class:`RemotePath`.
PathLike: TypeAlias = "str | os.PathLike[str] | RemotePath"
#: Where a file or folder is: a local ``Path`` or a :class:`RemotePath`.
Location: TypeAlias = "Path | RemotePath"

#: Metadata key under which a snapshot file records its writer and sequence number.
SNAPSHOT_METADATA_KEY: Final = b"lightning_pilot.snapshot"

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._+=@-]")
_MAX_COMPONENT = 128
_SAFE_COMPONENT = re.compile(rf"(?!\.)[A-Za-z0-9._+=@-]{{1,{_MAX_COMPONENT}}}")


def safe_path_component(value: object, argument: str) -> str:
    """Validate a name that becomes one component of a path.

    Accepts letters, digits and ``. _ + = @ -``; refuses anything that could leave the folder
    it is joined to (separators, ``..``, absolute paths, NUL, a leading dot that would hide
    the file from readers). Returns the name unchanged; ``argument`` names it in the error.

    Example:
        >>> safe_path_component("lr-1e-4", "variant")
        'lr-1e-4'
        >>> safe_path_component("../x", "variant")
        Traceback (most recent call last):
        ...
        ValueError: variant='../x' is not a safe name: use 1 to 128 letters, digits or ._+=@- ...
    """
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a string, got {type(value).__name__} {value!r}.")
    if not _SAFE_COMPONENT.fullmatch(value):
        raise ValueError(
            f"{argument}={value!r} is not a safe name: use 1 to {_MAX_COMPONENT} letters, digits"
            " or ._+=@- not starting with '.' (no separators, '..' or NUL)."
        )
    return value


def sanitize_name(value: str, *, fallback: str = "unnamed") -> str:
    """Turn free text into a safe path component by replacing every other character by ``_``.

    The mapping is not reversible: keep the original text in the data as well.

    Example:
        >>> sanitize_name("lr=1e-4 / warm up")
        'lr=1e-4___warm_up'
        >>> sanitize_name("../../etc/passwd")
        '__.._etc_passwd'
        >>> sanitize_name("")
        'unnamed'
    """
    cleaned = _UNSAFE_CHARS.sub("_", value)[:_MAX_COMPONENT]
    # A leading run of dots would hide the file or climb out of the folder.
    cleaned = re.sub(r"^\.+", "_", cleaned)
    return cleaned or fallback


class UnsafePathError(OSError):
    """A folder lightning-pilot would write into is a symbolic link inside the output folder
    (which may itself be one); an ``OSError``, so it travels the paths of a full disk."""


# -- Locations: a local Path, or a file or folder on an fsspec filesystem ----------------------

#: ``scheme://`` at the start of a string: a URL for fsspec, not a local path.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: fsspec's local protocols, with or without ``//``: ``file:/tmp/x`` is how Lightning spells
#: a ``file:///tmp/x`` root once it has normalised it, and fsspec (so Lightning's checkpoints)
#: reads it as ``/tmp/x``, never as a folder named ``file:`` in the working directory.
_LOCAL_URL = re.compile(r"(?:file|local):")
#: Protocols whose ``open(path, "xb")`` refuses an existing name in the same request that
#: creates it: S3 (s3fs sends ``If-None-Match: *``; refused with 412) and the in-process
#: ``memory://`` (checked and created under one lock). Others: checked, then written
#: (docs/storage.md, "What each backend guarantees").
EXCLUSIVE_CREATE_PROTOCOLS: Final = frozenset({"s3", "s3a", "memory"})
_MEMORY_LOCK = threading.Lock()
_WARNED_NOT_EXCLUSIVE: set[str] = set()


class _Stat(NamedTuple):
    st_size: int


class RemotePath:
    """A file or folder on an fsspec filesystem (``s3://``, ``gs://``, ``memory://``, ...),
    with the few ``pathlib.Path`` methods the readers and writers use.

    Make one with :func:`location`. It is deliberately not ``os.PathLike``: handing it to
    ``open()`` or to a library that writes local files raises ``TypeError`` instead of quietly
    writing a local folder named ``s3:``. ``str()`` gives the URL.

    Example:
        >>> folder = location("memory://pilot-doc/out")
        >>> folder, folder.name, str(folder / "ledger")
        (RemotePath('memory:///pilot-doc/out'), 'out', 'memory:///pilot-doc/out/ledger')
        >>> (folder / "ledger").exists()
        False
    """

    __slots__ = ("_info", "fs", "path")

    def __init__(
        self, fs: AbstractFileSystem, path: str, info: Mapping[str, Any] | None = None
    ) -> None:
        self.fs = fs
        self.path = path.rstrip("/") or path
        self._info = info  # from the listing that found it: type and size without a request

    @property
    def protocol(self) -> str:
        """The filesystem's protocol (``s3``, ``memory``, ...)."""
        protocol = self.fs.protocol
        return str(protocol if isinstance(protocol, str) else protocol[0])

    def __str__(self) -> str:
        return str(self.fs.unstrip_protocol(self.path))

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RemotePath):
            return NotImplemented
        return str(self) == str(other) and self.fs == other.fs

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: RemotePath) -> bool:
        return str(self) < str(other)

    def __truediv__(self, name: str) -> RemotePath:
        return self.joinpath(name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemotePath, (self.fs, self.path))

    def joinpath(self, *names: str) -> RemotePath:
        """This location joined with ``names`` (``/``-separated, as on every object store)."""
        return RemotePath(self.fs, posixpath.join(self.path, *names))

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, str(self.fs._parent(self.path)))

    def _fresh(self) -> None:
        # Listings are cached per filesystem instance; other processes write here too.
        self.fs.invalidate_cache(self.path)

    def exists(self) -> bool:
        self._fresh()
        return bool(self.fs.exists(self.path))

    def is_dir(self) -> bool:
        if self._info is not None:
            return self._info.get("type") == "directory"
        self._fresh()
        return bool(self.fs.isdir(self.path))

    def is_file(self) -> bool:
        if self._info is not None:
            return self._info.get("type") == "file"
        self._fresh()
        return bool(self.fs.isfile(self.path))

    def is_symlink(self) -> bool:
        """Always ``False``: object stores and fsspec filesystems have no symbolic links here."""
        return False

    def resolve(self) -> RemotePath:
        return self

    def stat(self) -> _Stat:
        if self._info is not None and self._info.get("size") is not None:
            return _Stat(int(self._info["size"]))
        self._fresh()
        return _Stat(int(self.fs.info(self.path)["size"]))

    def iterdir(self) -> Iterator[RemotePath]:
        """The entries of this folder, each knowing its type and size from the one listing."""
        self._fresh()
        for info in self.fs.ls(self.path, detail=True):
            entry = RemotePath(self.fs, str(info["name"]), info)
            if entry.path != self.path:
                yield entry

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """The entries of this folder whose name matches ``pattern`` (one level only)."""
        return (entry for entry in self.iterdir() if fnmatch.fnmatchcase(entry.name, pattern))

    def open(self, mode: str = "rb") -> BinaryIO:
        handle: BinaryIO = self.fs.open(self.path, mode)
        return handle

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.path))

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise
        self._fresh()

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Make the folder (object stores have none until a file is in them: then a no-op)."""
        self.fs.makedirs(self.path, exist_ok=True)


def is_remote(value: object) -> bool:
    """Whether ``value`` is a :class:`RemotePath` or a URL string that is not ``file://``.

    Example:
        >>> is_remote("s3://bucket/pilot"), is_remote("/tmp/pilot"), is_remote("file:///tmp")
        (True, False, False)
    """
    if isinstance(value, RemotePath):
        return True
    text = value if isinstance(value, str) else None
    return bool(text and _URL.match(text) and not text.lower().startswith(("file://", "local://")))


@overload
def location(value: RemotePath, **storage_options: Any) -> RemotePath: ...
@overload
def location(value: os.PathLike[str], **storage_options: Any) -> Path: ...
@overload
def location(value: PathLike, **storage_options: Any) -> Location: ...
def location(value: PathLike, **storage_options: Any) -> Location:
    """A local ``Path`` or, for a URL fsspec understands, a :class:`RemotePath`.

    A local path (``str``, or any ``os.PathLike``) becomes ``Path(value)`` unchanged. A string
    in fsspec's local protocols (``file:``, ``local:``, with or without ``//``) becomes the
    local path fsspec, and so Lightning's checkpoints, would write: ``file:///tmp/x`` and
    ``file:/tmp/x`` are ``/tmp/x``, ``file:runs`` and ``local://runs`` are ``runs`` in the
    working directory, ``file:~/runs`` is in the home folder (docs/storage.md, "A Trainer's
    root"). Any other ``scheme://`` URL is opened with fsspec: credentials,
    endpoints and other ``storage_options`` come from the arguments here, else from fsspec's
    configuration and the backend's usual environment (``AWS_*`` for s3fs); docs/storage.md
    says how. A chained URL (``simplecache::s3://...``) is refused.

    Example:
        >>> location("/tmp/pilot"), location("file:///tmp/pilot"), location("file:/tmp/pilot")
        (PosixPath('/tmp/pilot'), PosixPath('/tmp/pilot'), PosixPath('/tmp/pilot'))
        >>> location("memory://bucket/pilot") / "ledger"
        RemotePath('memory:///bucket/pilot/ledger')
    """
    if isinstance(value, RemotePath):
        return value if not storage_options else location(str(value), **storage_options)
    if isinstance(value, str) and "::" in value and _URL.search(value):
        raise ValueError(
            f"{value!r} is a chained fsspec URL; lightning-pilot writes to one filesystem:"
            " give a plain URL such as s3://bucket/folder."
        )
    if not isinstance(value, str) or not (_URL.match(value) or _LOCAL_URL.match(value)):
        return Path(value)
    text = value
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]
        from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]
    except ImportError as err:  # pragma: no cover - Lightning depends on fsspec
        raise ImportError(
            f"{text!r} is a URL: reading and writing it needs fsspec (pip install"
            " 'lightning-pilot[remote]')."
        ) from err
    try:
        fs, path = url_to_fs(text, **storage_options)
    except ImportError as err:
        raise ImportError(
            f"{text!r} needs the fsspec backend for its protocol: {err}. For s3:// install"
            " 'lightning-pilot[remote]' (s3fs)."
        ) from err
    if isinstance(fs, LocalFileSystem):
        return Path(path)
    return RemotePath(fs, path)


def _location_argument(owner: str, name: str, value: object, hint: str) -> Location:
    """``value`` checked as a folder argument (:func:`validate.path`), as a :func:`location`."""
    if isinstance(value, RemotePath):
        return value
    folder: Path = validate.path(owner, name, value, optional=False, hint=hint)
    return location(value) if isinstance(value, str) else folder


def work_folder(root: PathLike, *components: str) -> Path:
    """A local folder for files a library must write itself (checkpoints): ``root/components``
    (:func:`make_folder`) when ``root`` is local, else a folder of the temporary directory
    named after the remote location, so one run keeps finding the same one."""
    base = location(root)
    if isinstance(base, Path):
        return make_folder(base, *components)
    for component in components:
        safe_path_component(component, "path component")
    return make_folder(_remote_work_root(base), *components)


def _remote_work_root(base: RemotePath) -> Path:
    import hashlib
    import tempfile

    digest = hashlib.sha256(str(base).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"lightning-pilot-{digest}"


def remove_work_folder(root: PathLike) -> Path | None:
    """Remove the local folder :func:`work_folder` made for a remote ``root`` (the probe
    checkpoints and the export of a run whose ``out_dir`` is a URL) once the run needs it no
    more; return it, or ``None`` when there was none. A local ``root`` keeps its work folders:
    they are part of the output folder. A folder that cannot be removed whole is a warning,
    never an error (the run's results are already published).

    Example:
        >>> folder = work_folder("memory://doc-work/run", "resume")
        >>> remove_work_folder("memory://doc-work/run") == folder.parent, folder.exists()
        (True, False)
    """
    base = location(root)
    if isinstance(base, Path):
        return None
    local = _remote_work_root(base)
    if local.is_symlink() or not local.is_dir():
        return None
    import shutil

    try:
        shutil.rmtree(local)
    except OSError as err:
        warnings.warn(
            f"lightning-pilot: could not remove the work folder {local}: {err}",
            RuntimeWarning,
            stacklevel=2,
        )
    return local


def _refuse_link(folder: Location, root: Location | None = None) -> None:
    if isinstance(folder, Path) and folder.is_symlink():
        inside = f" inside the output folder {root}" if root is not None else ""
        raise UnsafePathError(
            f"{folder} is a symbolic link{inside} (to {os.readlink(folder)}); lightning-pilot"
            " refuses to write through links inside an output folder. Remove the link, or make"
            " the output folder itself the link (out_dir may be a symbolic link)."
        )


@overload
def safe_join(root: RemotePath, *components: str) -> RemotePath: ...
@overload
def safe_join(root: os.PathLike[str], *components: str) -> Path: ...
@overload
def safe_join(root: PathLike, *components: str) -> Location: ...
def safe_join(root: PathLike, *components: str) -> Location:
    """Join validated components to ``root`` for writing; no component may be a symbolic link.

    ``root`` itself may be a link; a link *inside* it, or a path resolving outside it, raises
    :class:`UnsafePathError`; a component that is not a safe name raises ``ValueError``. A
    remote ``root`` (:func:`location`) has no links: its components are checked as names.
    """
    base = location(root)
    for component in components:
        safe_path_component(component, "path component")
    if isinstance(base, RemotePath):
        return base.joinpath(*components)
    joined = base.joinpath(*components)
    current = base
    for component in components:
        current = current / component
        _refuse_link(current, base)
    resolved_root = base.resolve()
    resolved = joined.resolve()
    if resolved != resolved_root and resolved_root not in resolved.parents:
        raise UnsafePathError(f"{joined} resolves to {resolved}, outside the output folder {base}.")
    return joined


def _fsync_dir(folder: Path) -> None:
    # Directory fsync makes the new name durable; some platforms cannot open folders.
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
    except OSError as err:
        # File systems without hard links: fall back to a checked rename. The window between
        # the check and the rename is the only place an overwrite could still happen.
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

    A hidden temporary file in the same folder is fsynced, then published with a hard link
    (which refuses an existing name); on any error it is removed and the error propagates. A
    hidden name (``.``/``_``: readers skip it) is a ``ValueError``. ``replace=True`` is for a
    file derived from the tables and drawn again on purpose (a plot): it replaces an older one
    atomically instead of refusing it. On a :class:`RemotePath` the bytes are built in memory
    and created in one request that refuses an existing name where the backend can
    (:data:`EXCLUSIVE_CREATE_PROTOCOLS`; docs/storage.md).
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
    except BaseException as err:
        # The first error says what went wrong (a full disk, a read-only remount): a failed
        # clean-up must not replace it, only be noted on it.
        problem = _remove_temporary(tmp)
        if problem is not None:
            note = f"lightning-pilot: could not remove the temporary file {tmp}: {problem}"
            if sys.version_info >= (3, 11):
                err.add_note(note)
            else:  # pragma: no cover - Python 3.10 has no exception notes
                warnings.warn(note, RuntimeWarning, stacklevel=2)
        raise
    problem = _remove_temporary(tmp)
    if problem is not None:
        # Published: the hidden temporary file is invisible to readers, so only say so.
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
    """Publish on an fsspec filesystem: the whole file in one create (never a partial object)."""
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
    """Write ``table`` as Parquet to ``path`` atomically, never overwriting (see publish_file)."""
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


@overload
def make_folder(root: RemotePath, *components: str) -> RemotePath: ...
@overload
def make_folder(root: os.PathLike[str], *components: str) -> Path: ...
@overload
def make_folder(root: PathLike, *components: str) -> Location: ...
def make_folder(root: PathLike, *components: str) -> Location:
    """Make (if needed) and return the folder ``root/components``, checked by :func:`safe_join`."""
    folder = safe_join(root, *components)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _check_columns(row: Mapping[str, Any], schema: pa.Schema, what: str) -> None:
    unknown = sorted(set(row) - set(schema.names))
    if unknown:
        raise ValueError(
            f"{what} has unknown column(s) {unknown}; valid columns are {schema.names}."
        )


def rows_to_table(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """Build a table of ``schema`` from row dicts; absent columns are null.

    A column the schema lacks, or a value that does not fit its column's type, is a
    ``ValueError`` naming the column.
    """
    for row in rows:
        _check_columns(row, schema, "a row")
    arrays = []
    for field in schema:
        values = [row.get(field.name) for row in rows]
        try:
            arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as err:
            raise ValueError(
                f"column {field.name!r} expects {field.type}, got values {values[:3]!r}: {err}"
            ) from err
    return pa.Table.from_arrays(arrays, schema=schema)


def write_snapshot(folder: PathLike, table: pa.Table, *, writer: str, seq: int) -> Location:
    """Publish one snapshot of a growing table and remove this writer's older snapshots.

    ``table`` holds every row this writer has so far (a snapshot replaces, it does not append);
    ``writer`` (a safe name, e.g. ``a0001-r00000-<attempt_id>``) never runs in two processes at
    once, and its ``seq`` strictly increases. A ``folder`` that is a link: :class:`UnsafePathError`.
    """
    safe_path_component(writer, "writer")
    validate.integer("write_snapshot", "seq", seq, minimum=0)
    target = location(folder)
    _refuse_link(target)
    meta = dict(table.schema.metadata or {})
    meta[SNAPSHOT_METADATA_KEY] = json.dumps({"writer": writer, "seq": seq}).encode()
    path = publish_table(
        table.replace_schema_metadata(meta), target / f"part-{writer}-{seq:08d}.parquet"
    )
    # The new snapshot holds every row of the older ones: remove those so a plain
    # ``pandas.read_parquet(folder)`` sees each row once. A crash before this point leaves
    # both, and the readers below still keep only the newest.
    pattern = re.compile(rf"part-{re.escape(writer)}-(\d{{8}})\.parquet")
    for old in target.iterdir():
        match = pattern.fullmatch(old.name)
        if match and int(match.group(1)) < seq:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
    return path


def write_ledger_record(ledger_dir: PathLike, record: Mapping[str, Any]) -> Location:
    """Publish one immutable run-ledger record as its own Parquet file.

    ``run_id`` and ``event`` are required; ``schema_version``, ``record_id`` and ``written_at``
    are filled in when absent. The file name starts with the time, so a listing is in write
    order. A record the readers would skip (over :data:`LEDGER_RECORD_LIMITS`) is refused.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> path = write_ledger_record(folder, {"run_id": new_run_id(), "event": "start",
        ...                                      "status": "running"})
        >>> read_ledger_records(folder)["status"].tolist()
        ['running']
    """
    folder = _location_argument("write_ledger_record", "ledger_dir", ledger_dir, "a folder")
    _check_columns(record, LEDGER_SCHEMA, "ledger record")
    run_id = validate_run_id(record.get("run_id"), "record['run_id']")
    owner = "write_ledger_record"
    event = validate.choice(owner, "record['event']", record.get("event"), LEDGER_EVENTS)
    validate.choice(owner, "record['status']", record.get("status"), STATUSES, optional=True)
    full = dict(record)
    full.setdefault("schema_version", LEDGER_SCHEMA_VERSION)
    full.setdefault("record_id", new_run_id())
    full.setdefault("written_at", _utcnow())
    record_id = safe_path_component(full["record_id"], "record['record_id']")
    stamp = full["written_at"].strftime("%Y%m%dT%H%M%S%fZ")
    name = f"{stamp}-{run_id}-{event}-{record_id}.parquet"
    table = rows_to_table([full], LEDGER_SCHEMA)
    _check_writable(table, LEDGER_RECORD_LIMITS, "a ledger record")
    _refuse_link(folder)
    return publish_table(table, folder / name)


class SkippedFileWarning(RuntimeWarning):
    """A reader skipped a file: unreadable, over its limits, or not where the layout expects it
    (the result lists those paths too: ``attrs["skipped"]``, ``skipped=``, ``Ledger.skipped``)."""


@dataclass(frozen=True)
class ReadLimits:
    """What a reader agrees to decode from one Parquet file, checked on the footer first.

    A few KB of Parquet can declare millions of rows or one long string repeated thousands of
    times, so a file over any limit is skipped with a :class:`SkippedFileWarning` quoting
    ``name``. ``max_values`` counts one leaf column (list elements and nulls included); the
    byte limits count the columns read, as pages and in Arrow memory.

    Example:
        >>> PHASE_FILE_LIMITS.max_rows, LEDGER_RECORD_LIMITS.max_rows
        (100000, 1000)
    """

    name: str
    max_file_bytes: int
    max_footer_bytes: int
    max_rows: int
    max_columns: int
    max_row_groups: int
    max_values: int
    max_uncompressed_bytes: int
    max_decoded_bytes: int


_MIB: Final = 1 << 20

#: One phase-table snapshot: a writer's rows are a few dozen, a long multi-stage run's hundreds.
PHASE_FILE_LIMITS: Final = ReadLimits(
    name="PHASE_FILE_LIMITS",
    max_file_bytes=64 * _MIB,
    max_footer_bytes=4 * _MIB,
    max_rows=100_000,
    max_columns=256,
    max_row_groups=64,
    max_values=2_000_000,
    max_uncompressed_bytes=256 * _MIB,
    max_decoded_bytes=256 * _MIB,
)
#: One ledger record file: one row; an end record carries whole curves (2 values per point),
#: so ``max_values`` admits curves of 2 million updates.
LEDGER_RECORD_LIMITS: Final = replace(
    PHASE_FILE_LIMITS, name="LEDGER_RECORD_LIMITS", max_rows=1_000, max_row_groups=16
)
#: One ledger index segment: :func:`index_ledger` cuts them at half these limits.
LEDGER_SEGMENT_LIMITS: Final = replace(
    PHASE_FILE_LIMITS,
    name="LEDGER_SEGMENT_LIMITS",
    max_file_bytes=256 * _MIB,
    max_rows=50_000,
    max_values=4_000_000,
    max_uncompressed_bytes=512 * _MIB,
    max_decoded_bytes=512 * _MIB,
)
#: Every other table (detail tables such as ``updates`` with one row per update, validation
#: predictions), the default of :func:`read_parquet_files` and :func:`read_snapshot_table`.
DETAIL_FILE_LIMITS: Final = ReadLimits(
    name="DETAIL_FILE_LIMITS",
    max_file_bytes=1024 * _MIB,
    max_footer_bytes=16 * _MIB,
    max_rows=5_000_000,
    max_columns=1_024,
    max_row_groups=1_024,
    max_values=50_000_000,
    max_uncompressed_bytes=2048 * _MIB,
    max_decoded_bytes=2048 * _MIB,
)

#: Index segments are cut well inside :data:`LEDGER_SEGMENT_LIMITS`: rows, values, bytes.
_SEGMENT_CUT: Final = (10_000, 2_000_000, 128 * _MIB)

_FIXED_WIDTH: Final = {"BOOLEAN": 1, "INT32": 4, "INT64": 8, "INT96": 12, "FLOAT": 4, "DOUBLE": 8}
#: Text encodings whose decoded bytes are at most the page bytes.
_TEXT_ENCODINGS: Final = frozenset({"PLAIN", "RLE", "BIT_PACKED", "DELTA_LENGTH_BYTE_ARRAY"})
_DICTIONARY_ENCODINGS: Final = frozenset({"PLAIN_DICTIONARY", "RLE_DICTIONARY"})
_OVERHEAD: Final = 8  # per value: offsets, validity and levels, generously


class _OverLimitError(ValueError):
    """A file declares more than its :class:`ReadLimits` allow (found before decoding)."""


def _over(limits: ReadLimits, field: str, value: int, what: str) -> _OverLimitError:
    return _OverLimitError(f"{value:,} {what} > {limits.name}.{field}={getattr(limits, field):,}")


def _within(limits: ReadLimits, field: str, value: int, what: str) -> None:
    if value > getattr(limits, field):
        raise _over(limits, field, value, what)


def _footer_bytes(tail: bytes, size: int) -> int | None:
    """The footer length a Parquet file of ``size`` bytes ending with ``tail`` declares."""
    # The file ends with the footer, its length (4 bytes, little-endian) and b"PAR1".
    if size < 12 or len(tail) < 8 or tail[-4:] != b"PAR1":
        return None  # not Parquet: pyarrow says so when it opens it
    length = int.from_bytes(tail[-8:-4], "little")
    return length if length <= size - 12 else None  # longer than the file: corrupt, not big


def _cast(array: Any, name: str, want: pa.DataType) -> Any:
    """``array`` cast to ``want``; a ``ValueError`` naming the column when it cannot be."""
    try:
        return array.cast(want)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
        raise ValueError(f"column {name!r} of type {array.type} cannot be read as {want}") from err


def _check_types(arrow: pa.Schema, schema: pa.Schema, names: Sequence[str]) -> None:
    for name in names:
        index = arrow.get_field_index(name)
        if index < 0:
            raise ValueError(f"column {name!r} appears more than once")
        have, want = arrow.field(index).type, schema.field(name).type
        if have != want:
            _cast(pa.array([], type=have), name, want)


def _check_footer(
    parquet: pq.ParquetFile, data: bytes, limits: ReadLimits, schema: pa.Schema | None
) -> list[str] | None:
    """Compare a file's footer with ``limits``; return the columns to read (None: all).

    Nothing is decoded, except the dictionaries and indices of text columns whose worst case
    (every value as long as the whole chunk) is over the limit, to measure them exactly.
    """
    meta = parquet.metadata
    _within(limits, "max_rows", meta.num_rows, "rows")
    _within(limits, "max_columns", meta.num_columns, "columns")
    _within(limits, "max_row_groups", meta.num_row_groups, "row groups")
    arrow = parquet.schema_arrow
    columns: list[str] | None = None
    if schema is not None:
        # Columns the schema does not know are dropped by ``conform``: never decode them.
        present = set(arrow.names)
        columns = [name for name in schema.names if name in present]
        if not arrow.equals(schema, check_metadata=False):
            _check_types(arrow, schema, columns)
        if len(columns) == len(arrow.names):
            columns = None  # every column of the file is read
    leaves = parquet.schema
    read = _leaf_indices(arrow, meta.num_columns, columns, leaves)
    rows = uncompressed = decoded = worst = 0
    values = dict.fromkeys(read, 0)
    texts: list[tuple[int, int, int, int]] = []  # (row group, leaf, values, page bytes)
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        rows += group.num_rows
        for i in read:
            chunk = group.column(i)
            count, size, kind = chunk.num_values, chunk.total_uncompressed_size, chunk.physical_type
            values[i] += count
            uncompressed += size
            if kind in _FIXED_WIDTH:
                decoded += count * (_FIXED_WIDTH[kind] + _OVERHEAD)
            elif kind == "FIXED_LEN_BYTE_ARRAY":
                decoded += count * (max(leaves.column(i).length, 0) + _OVERHEAD)
            else:  # BYTE_ARRAY: text and binary
                decoded += count * _OVERHEAD + size
                if count > 1:
                    # With a dictionary (or prefix sharing) a short page can stand for many
                    # long values: at worst each is as long as the whole chunk.
                    worst += count * size
                    texts.append((g, i, count, size))
    _within(limits, "max_rows", rows, "rows in its row groups")
    _within(limits, "max_values", max(values.values(), default=0), "values in one column")
    _within(limits, "max_uncompressed_bytes", uncompressed, "bytes of pages")
    _within(limits, "max_decoded_bytes", decoded, "bytes once decoded")
    if decoded + worst <= limits.max_decoded_bytes:
        return columns
    # Only now read the encodings (slow to fetch): which text chunks can repeat values?
    worst, amplified, unmeasurable = 0, set(), False
    for g, i, count, size in texts:
        encodings = set(meta.row_group(g).column(i).encodings)
        if encodings <= _TEXT_ENCODINGS:
            continue  # every value is on a page: decoded at most the page bytes
        worst += count * size
        amplified.add(i)
        unmeasurable = unmeasurable or not encodings <= _TEXT_ENCODINGS | _DICTIONARY_ENCODINGS
    if decoded + worst <= limits.max_decoded_bytes:
        return columns
    if unmeasurable:
        what = "bytes once decoded at worst (an encoding whose size cannot be measured first)"
        raise _over(limits, "max_decoded_bytes", decoded + worst, what)
    paths = [leaves.column(i).path for i in sorted(amplified)]
    total = decoded + _dictionary_bytes(data, paths)
    _within(limits, "max_decoded_bytes", total, "bytes once decoded")
    return columns


@functools.lru_cache(maxsize=1024)
def _leaf_count(kind: pa.DataType) -> int:
    """How many Parquet leaf columns a column of this Arrow type is stored as."""
    if pa.types.is_dictionary(kind) or kind.num_fields == 0:
        return 1
    return sum(_leaf_count(kind.field(i).type) for i in range(kind.num_fields))


def _leaf_indices(
    arrow: pa.Schema, count: int, columns: Sequence[str] | None, leaves: pq.ParquetSchema
) -> list[int]:
    """The Parquet leaf columns that store the top-level ``columns`` (None: all)."""
    if columns is None or len(columns) == len(arrow.names):
        return list(range(count))
    wanted = set(columns)
    sizes = [_leaf_count(field.type) for field in arrow]
    if sum(sizes) != count:  # an unusual mapping: ask each leaf its path
        return [i for i in range(count) if leaves.column(i).path.split(".")[0] in wanted]
    read: list[int] = []
    start = 0
    for field, size in zip(arrow, sizes, strict=True):
        if field.name in wanted:
            read.extend(range(start, start + size))
        start += size
    return read


def _dictionary_bytes(data: bytes, paths: Sequence[str]) -> int:
    """The bytes the text columns at ``paths`` take decoded, from their dictionaries."""
    parquet = pq.ParquetFile(pa.BufferReader(data), read_dictionary=list(paths))
    top = sorted({path.split(".")[0] for path in paths})
    table = parquet.read(columns=top, use_threads=False)
    return sum(_value_bytes(chunk) for column in table.columns for chunk in column.chunks)


def _value_bytes(array: pa.Array) -> int:
    kind = array.type
    if pa.types.is_dictionary(kind):
        lengths = pa.compute.binary_length(array.dictionary)
        total = pa.compute.sum(pa.compute.take(lengths, array.indices)).as_py()
        return int(total or 0) + _OVERHEAD * len(array)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _value_bytes(array.flatten()) + _OVERHEAD * len(array)
    if pa.types.is_struct(kind):
        return sum(_value_bytes(field) for field in array.flatten())
    return int(array.nbytes)


def _leaf_values(array: pa.Array) -> int:
    """The most values one leaf column of ``array`` holds, as Parquet will count them."""
    kind = array.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return len(array) + _leaf_values(array.flatten())
    if pa.types.is_struct(kind):
        return max([len(array), *(_leaf_values(field) for field in array.flatten())])
    return len(array)


def _most_values(table: pa.Table) -> int:
    return max(
        (sum(_leaf_values(chunk) for chunk in column.chunks) for column in table.columns),
        default=0,
    )


def _check_writable(table: pa.Table, limits: ReadLimits, what: str) -> None:
    """Refuse to write what a reader would skip (``ValueError`` naming the limit)."""
    measures = (
        ("max_rows", table.num_rows, "rows"),
        ("max_values", _most_values(table), "values in one column"),
        ("max_decoded_bytes", table.nbytes, "bytes"),
    )
    problems = [
        str(_over(limits, field, value, what))
        for field, value, what in measures
        if value > getattr(limits, field)
    ]
    if problems:
        raise ValueError(
            f"{what} of {'; '.join(problems)} would be skipped by every reader; it is not"
            " written (shorten its curves or lists)."
        )


def _read_limited(file: Location, limits: ReadLimits, schema: pa.Schema | None) -> pa.Table:
    """Read one Parquet file, checking its size and footer against ``limits`` first, then
    conform it to ``schema`` (or, without one, decode its dictionary columns)."""
    _within(limits, "max_file_bytes", file.stat().st_size, "bytes on disk")
    # Reading the bytes first and decoding without threads is about twice as fast as
    # pq.read_table for the small one-record files of a ledger.
    if isinstance(file, RemotePath):
        data = file.read_bytes()  # one request
    else:
        with open(file, "rb") as handle:
            data = handle.read()
    footer = _footer_bytes(data[-8:], len(data))
    if footer is not None and footer > limits.max_footer_bytes:
        raise _over(limits, "max_footer_bytes", footer, "bytes of footer")
    parquet = pq.ParquetFile(pa.BufferReader(data))
    table = parquet.read(columns=_check_footer(parquet, data, limits, schema), use_threads=False)
    return conform(table, schema) if schema is not None else _decode_dictionaries(table)


def _skip(message: str, path: Location, skipped: list[str] | None, *, stacklevel: int = 3) -> None:
    warnings.warn(f"lightning-pilot: {message}", SkippedFileWarning, stacklevel=stacklevel)
    if skipped is not None:
        skipped.append(str(path))


def _visible_parquet_files(folder: Location) -> list[Location]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix == ".parquet" and not p.name.startswith((".", "_"))
    )


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Give ``table`` exactly the columns of ``schema``: cast what is there, null what is not.

    Columns the schema does not know (a newer version's) are dropped; one that cannot be cast
    is a ``ValueError``.
    """
    if table.schema.equals(schema, check_metadata=False):
        return table.replace_schema_metadata(schema.metadata)  # already conforming: no copy
    arrays = []
    for field in schema:
        if field.name in table.column_names:
            arrays.append(_cast(table.column(field.name), field.name, field.type))
        else:
            arrays.append(pa.nulls(table.num_rows, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _decode_dictionaries(table: pa.Table) -> pa.Table:
    # Without a schema, files are concatenated as they are: a dictionary-encoded column in one
    # file and a plain one in another would not concatenate.
    for index, field in enumerate(table.schema):
        if pa.types.is_dictionary(field.type):
            column = table.column(index).cast(field.type.value_type)
            table = table.set_column(index, field.name, column)
    return table


def read_parquet_files(
    files: Iterable[PathLike],
    schema: pa.Schema | None = None,
    *,
    limits: ReadLimits = DETAIL_FILE_LIMITS,
    skipped: list[str] | None = None,
) -> pa.Table:
    """Read Parquet files one by one and concatenate them into one table.

    A file over ``limits`` or unreadable is skipped with a :class:`SkippedFileWarning` and its
    path appended to ``skipped``. With a ``schema`` every file is conformed to it; without one
    the files must share a schema.
    """
    tables: list[tuple[Location, pa.Table]] = []
    for file in files:
        path = location(file)
        try:
            table = _read_limited(path, limits, schema)
        except _OverLimitError as err:
            _skip(f"skipped oversized file {path}: {err} (not decoded)", path, skipped)
        except (OSError, pa.ArrowException, ValueError) as err:
            message = f"skipped unreadable file {path}: {type(err).__name__}: {err}"
            _skip(message, path, skipped)
        else:
            tables.append((path, table))
    if not tables:
        return schema.empty_table() if schema is not None else pa.table({})
    # One chunk per column: pandas operations on a column of thousands of one-row chunks (one
    # per file) are tens of times slower.
    if schema is not None:
        return pa.concat_tables([table for _, table in tables]).combine_chunks()
    try:
        together = pa.concat_tables([t for _, t in tables], promote_options="permissive")
    except pa.ArrowException:
        together = tables[0][1]
        for path, table in tables[1:]:
            try:
                together = pa.concat_tables([together, table], promote_options="permissive")
            except pa.ArrowException as err:
                _skip(f"skipped {path}: its columns do not match the others: {err}", path, skipped)
    return together.combine_chunks()


def _snapshot_identity(path: Location) -> tuple[str, int]:
    """The (writer, seq) a snapshot file records, or its own name when it records none."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            handle.seek(max(size - 8, 0))
            footer = _footer_bytes(handle.read(8), size)
            if footer is None or footer > DETAIL_FILE_LIMITS.max_footer_bytes:
                return path.name, 0  # the read that follows reports it
            handle.seek(0)
            meta = pq.read_schema(handle).metadata or {}
        info = json.loads(meta[SNAPSHOT_METADATA_KEY])
        return str(info["writer"]), int(info["seq"])
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError):
        return path.name, 0


def list_snapshot_files(folder: PathLike) -> list[Location]:
    """The newest snapshot file of each writer in a table folder (sorted by name); files that
    record no snapshot identity (copied in by hand, say) are all kept."""
    target = location(folder)
    if not target.is_dir():
        return []
    newest: dict[str, tuple[int, Location]] = {}
    for path in _visible_parquet_files(target):
        writer, seq = _snapshot_identity(path)
        if writer not in newest or seq > newest[writer][0]:
            newest[writer] = (seq, path)
    return sorted((path for _, path in newest.values()), key=str)


def read_snapshot_table(
    folder: PathLike,
    schema: pa.Schema | None = None,
    *,
    limits: ReadLimits = DETAIL_FILE_LIMITS,
    skipped: list[str] | None = None,
) -> pa.Table:
    """Read the newest snapshot of every writer in a table folder (:func:`read_parquet_files`)."""
    return read_parquet_files(list_snapshot_files(folder), schema, limits=limits, skipped=skipped)


@overload
def run_folders(path: RemotePath) -> list[RemotePath]: ...
@overload
def run_folders(path: Path) -> list[Path]: ...
@overload
def run_folders(path: Location) -> list[Location]: ...
def run_folders(path: Location) -> list[Any]:
    """Run folders under ``path``: a run folder itself, or an ``out_dir`` holding ``runs/``."""
    if (path / "phases.parquet").exists():
        return [path]
    runs = path / "runs"
    if runs.is_dir():
        found: Iterable[Location] = runs.iterdir()
        return sorted((p for p in found if p.is_dir() and not p.name.startswith(".")), key=str)
    return []


def _what_is(path: Location) -> str:
    if path.is_symlink() and not path.exists():
        return "a broken symbolic link"
    return "a plain file" if path.is_file() else "something that is not a folder"


def read_phase_table(path: PathLike) -> pd.DataFrame:
    """Read the phase table of one run or of every run under an output folder.

    ``path`` is a run folder, a ``phases.parquet`` folder or an ``<out_dir>`` (all runs). One
    row per phase, attempt and rank, with nullable dtypes (an unmeasured value is ``<NA>``,
    never 0); ``attrs["skipped"]`` lists what could not be read, each also warned about.
    """
    hint = "a run, phase-table or output folder"
    root = _location_argument("read_phase_table", "path", path, hint)
    if not root.exists():
        raise FileNotFoundError(f"path={str(root)!r} does not exist.")
    if root.name == "phases.parquet":
        tables = [root]
    else:
        tables = [run / "phases.parquet" for run in run_folders(root)]
        tables = [table for table in tables if table.exists() or table.is_symlink()]
    if not tables:
        raise ValueError(
            f"path={str(root)!r} holds no phase table: expected"
            " <out_dir>/runs/<run_id>/phases.parquet."
        )
    skipped: list[str] = []
    folders = [table for table in tables if table.is_dir()]
    for table in (table for table in tables if table not in folders):
        # Never read as an empty, clean table: the run's verdicts would vanish with it.
        _skip(
            f"skipped {table}: expected a folder of snapshot parts"
            f" (phases.parquet/part-<writer>-<seq>.parquet), found {_what_is(table)};"
            " this run's phase rows are not read",
            table,
            skipped,
            stacklevel=2,
        )
    files = [file for folder in folders for file in list_snapshot_files(folder)]
    frame = _to_pandas(
        read_parquet_files(files, PHASE_SCHEMA, limits=PHASE_FILE_LIMITS, skipped=skipped)
    )
    if len(frame):
        # Runs in time order, then attempts and ranks, then phases in campaign order with each
        # phase's first occurrence before the rest.
        order = {phase: index for index, phase in enumerate(PHASES)}
        keys = frame["phase"].map(order).fillna(len(order))
        frame = (
            frame.assign(_order=keys, _later=~frame["first"].fillna(False).astype(bool))
            .sort_values(["run_id", "attempt", "rank", "_order", "_later"], kind="stable")
            .drop(columns=["_order", "_later"])
            .reset_index(drop=True)
        )
    frame.attrs["skipped"] = skipped
    return frame


#: Ledger index segments live here, hidden from pandas and pyarrow dataset readers.
LEDGER_INDEX_DIR: Final = "_index"
_SOURCE_COLUMN: Final = "source_file"  # segments written before compaction named their files
#: How long a compacted record file (or a merged segment) stays after the segment holding it
#: was published, by default (docs/ledger.md, "Compaction").
LEDGER_GRACE_SECONDS: Final = 3600.0
#: ``<written_at>-<run_id>-<event>-<record_id>.parquet``: run ids are hex after the time, so
#: the first ``-<event>-`` is the event and the rest the record id.
_RECORD_NAME: Final = re.compile(
    r"\d{8}T\d+Z-\d{8}T\d{9}Z-[0-9a-f]{16}-(?:start|heartbeat|end)-(?P<record_id>.+)\.parquet"
)
_SEGMENT_STAMP: Final = re.compile(r"segment-(\d{8}T\d{12}Z)-")
_STAMP_FORMAT: Final = "%Y%m%dT%H%M%S%fZ"
_READ_TRIES: Final = 3
#: Compaction merges small segments (under half a segment's records) once there are this many
#: (the new records counting as one): each record is rewritten a few times, not at every run.
_MERGE_AT: Final = 4


#: A hidden temporary file of :func:`publish_file`: ``.<name>.<uuid hex>.tmp``.
_TEMPORARY_NAME: Final = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")
#: A hidden temporary file younger than this is never removed by a compaction, whatever its
#: ``grace``: a live writer may still publish it (one takes milliseconds; docs/ledger.md).
TEMPORARY_GRACE_SECONDS: Final = 600.0


class _VanishedError(Exception):
    """A file listed a moment ago is gone (a compactor removed it): list again."""


def _ledger_folder(path: PathLike, owner: str) -> Location:
    root = _location_argument(owner, "path", path, "the ledger folder")
    if not root.exists():
        raise FileNotFoundError(f"path={str(root)!r} does not exist.")
    return root / "ledger" if (root / "ledger").is_dir() else root


def _ledger_files(folder: Location) -> list[Location]:
    """The visible Parquet files of one ledger folder, by name (one listing, no stat per file:
    a ledger folder may hold hundreds of thousands before compaction)."""
    if isinstance(folder, RemotePath):
        if not folder.is_dir():
            return []
        return _visible_parquet_files(folder)
    try:
        with os.scandir(folder) as entries:
            names = [
                entry.name
                for entry in entries
                if entry.name.endswith(".parquet")
                and not entry.name.startswith((".", "_"))
                and entry.is_file()
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [folder / name for name in sorted(names)]


def _record_id_of(name: str) -> str | None:
    """The record id a record file's name carries (None for a name the writer did not make)."""
    match = _RECORD_NAME.fullmatch(name)
    return match.group("record_id") if match else None


def _segment_time(name: str) -> datetime | None:
    match = _SEGMENT_STAMP.match(name)
    if not match:
        return None
    return datetime.strptime(match.group(1), _STAMP_FORMAT).replace(tzinfo=timezone.utc)


class _Segment(NamedTuple):
    path: Location
    table: pa.Table

    @property
    def ids(self) -> frozenset[str]:
        """The record ids this segment holds (built when asked: readers seldom need them)."""
        return frozenset(i for i in self.table.column("record_id").to_pylist() if i is not None)


def _read_segments(
    folder: Location,
    schema: pa.Schema,
    *,
    vanish: bool = True,
    skipped: list[str] | None = None,
) -> list[_Segment]:
    """The readable index segments of a ledger, conformed to ``schema``; a bad one is skipped
    with a warning and listed in ``skipped`` (a reader's; a compactor passes none): while its
    record files are there it costs speed only, but once a compaction removed them its records
    are lost with it. A segment gone since the listing: :class:`_VanishedError`."""
    segments = []
    for segment in _ledger_files(folder / LEDGER_INDEX_DIR):
        try:
            table = _read_limited(segment, LEDGER_SEGMENT_LIMITS, schema)
        except FileNotFoundError:
            if vanish:
                raise _VanishedError(str(segment)) from None
            if skipped is not None:  # a reader's last try: its records may be missing
                _skip(f"skipped ledger index {segment}: removed while read", segment, skipped)
        except _OverLimitError as err:
            message = f"skipped oversized ledger index {segment}: {err} (not decoded)"
            _skip(message, segment, skipped)
        except (OSError, pa.ArrowException, ValueError) as err:
            _skip(f"skipped unreadable ledger index {segment}: {err}", segment, skipped)
        else:
            segments.append(_Segment(segment, table))
    return segments


def _cut_table(table: pa.Table) -> list[pa.Table]:
    """Cut ``table`` into consecutive slices, each within :data:`_SEGMENT_CUT`."""
    rows = table.num_rows
    if rows == 0:
        return []
    values = np.ones(rows, dtype=np.int64)  # a list cell counts itself and its elements
    for column in table.columns:
        if pa.types.is_list(column.type):
            lengths = pa.compute.list_value_length(column).fill_null(0)
            values = np.maximum(values, 1 + lengths.to_numpy(zero_copy_only=False))
    per_row = max(1, table.nbytes // rows)
    slices, start, total_values = [], 0, 0
    for end in range(rows):
        total_values += int(values[end])
        count = end - start + 1
        if count > 1 and (
            count > _SEGMENT_CUT[0]
            or total_values > _SEGMENT_CUT[1]
            or count * per_row > _SEGMENT_CUT[2]
        ):
            slices.append(table.slice(start, end - start))
            start, total_values = end, int(values[end])
    slices.append(table.slice(start))
    return slices


def _sorted_records(table: pa.Table) -> pa.Table:
    return table.sort_by([("written_at", "ascending"), ("record_id", "ascending")])


def _publish_segments(folder: Location, table: pa.Table) -> list[_Segment]:
    written = []
    for part in _cut_table(_sorted_records(_unique_records(table))):
        part = part.combine_chunks()
        name = f"segment-{_utcnow().strftime(_STAMP_FORMAT)}-{uuid.uuid4().hex[:12]}.parquet"
        path = publish_table(part, folder / LEDGER_INDEX_DIR / name)
        written.append(_Segment(path, part))
    return written


#: Record files read for compaction are joined into one table this many at a time: a table
#: read from a file carries about 75 KB of Arrow objects, so 290,000 of them held apart took
#: 22 GB; joined, the records take what their values take.
_PENDING_JOIN: Final = 2_000


def _read_pending(files: Sequence[Location]) -> list[pa.Table]:
    """Read record files for compaction, joined :data:`_PENDING_JOIN` at a time: unreadable,
    oversized or vanished ones stay out (the readers report what they cannot read; a vanished
    one is in a segment already)."""
    tables: list[pa.Table] = []
    batch: list[pa.Table] = []
    for position, file in enumerate(files, 1):
        with contextlib.suppress(OSError, pa.ArrowException, ValueError):
            batch.append(_read_limited(file, LEDGER_RECORD_LIMITS, LEDGER_SCHEMA))
        if batch and (position % _PENDING_JOIN == 0 or position == len(files)):
            tables.append(pa.concat_tables(batch).combine_chunks())
            batch = []
    return tables


def compact_ledger(path: PathLike, *, grace: float | None = LEDGER_GRACE_SECONDS) -> list[Location]:
    """Compact a ledger: copy the records no segment holds into new index segments, merge
    small segments, and remove what a segment has held for ``grace`` seconds.

    Safe with any number of writers, readers and compactors at once, on any machine: nothing
    is renamed or locked. A segment holds whole records (:data:`LEDGER_SCHEMA`, each with its
    ``record_id``), so readers take every segment plus the record files no segment holds, and
    read a record found twice once. A record file is removed only once a segment published at
    least ``grace`` seconds earlier holds its record; a segment only once larger segments at
    least that old hold all its records (so a copy always remains). The hidden temporary
    files of publications killed half-way (in the ledger folder and ``_index/``) are removed
    once older than ``grace`` and :data:`TEMPORARY_GRACE_SECONDS`. ``grace=None`` removes
    nothing and merges nothing (:func:`index_ledger`). Returns the new segments.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = write_ledger_record(folder, {"run_id": new_run_id(), "event": "start"})
        >>> [p.parent.name for p in compact_ledger(folder, grace=0)]
        ['_index']
        >>> len(list(Path(folder).glob("*.parquet"))), len(read_ledger_records(folder))
        (0, 1)
    """
    if grace is not None:
        grace = validate.number("compact_ledger", "grace", grace, minimum=0, hint="seconds")
    folder = _ledger_folder(path, "compact_ledger")
    _refuse_link(folder)
    _refuse_link(folder / LEDGER_INDEX_DIR, folder)
    files = _ledger_files(folder)  # records first, then segments: see read_ledger_records
    segments = _read_segments(folder, LEDGER_SCHEMA, vanish=False)
    ids = {s.path.name: s.ids for s in segments}
    covered = set().union(*ids.values())
    pending = [f for f in files if _record_id_of(f.name) not in covered]
    tables = _read_pending(pending)
    # A segment whose records a larger one holds is waiting to be removed: never merged again.
    order = sorted(segments, key=lambda s: (s.table.num_rows, s.path.name), reverse=True)
    held: set[str] = set()
    superseded = set()
    for segment in order:
        if ids[segment.path.name] <= held:
            superseded.add(segment.path.name)
        held |= ids[segment.path.name]
    if grace is not None:
        small = [
            s
            for s in segments
            if s.table.num_rows < _SEGMENT_CUT[0] // 2 and s.path.name not in superseded
        ]
        if len(small) + bool(tables) >= _MERGE_AT:
            tables.extend(s.table for s in small)
    written = _publish_segments(folder, pa.concat_tables(tables)) if tables else []
    if grace is None:
        return [s.path for s in written]
    segments += written
    ids.update({s.path.name: s.ids for s in written})
    cutoff = _utcnow().timestamp() - grace
    for where in (folder, folder / LEDGER_INDEX_DIR):
        _remove_stale_temporaries(where, cutoff - max(0.0, TEMPORARY_GRACE_SECONDS - grace))

    def settled(segment: _Segment) -> bool:
        made = _segment_time(segment.path.name)
        return made is not None and made.timestamp() <= cutoff

    kept: set[str] = set()  # records held by settled segments kept so far, largest first
    for segment in sorted(segments, key=lambda s: (s.table.num_rows, s.path.name), reverse=True):
        held_here = ids[segment.path.name]
        if held_here and held_here <= kept:
            with contextlib.suppress(FileNotFoundError):
                segment.path.unlink()
        elif settled(segment):
            kept |= held_here
    for file in files:
        if _record_id_of(file.name) in kept:
            with contextlib.suppress(FileNotFoundError):
                file.unlink()
    return [s.path for s in written]


def _remove_stale_temporaries(folder: Location, cutoff: float) -> list[Path]:
    """Remove the hidden temporary files a killed :func:`publish_file` left in a local
    ``folder`` (plain files named ``.<name>.<uuid hex>.tmp``) last modified before ``cutoff``
    (a POSIX time); return them. Readers never see them; an object store has none (a remote
    publication is one whole-object write)."""
    removed: list[Path] = []
    if not isinstance(folder, Path):
        return removed
    try:
        with os.scandir(folder) as entries:
            stale = [entry for entry in entries if _TEMPORARY_NAME.fullmatch(entry.name)]
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in stale:
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_mtime >= cutoff:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue  # its writer (or another compactor) removed it meanwhile
        removed.append(Path(entry.path))
    return removed


def index_ledger(path: PathLike) -> Location | None:
    """Copy the ledger's not-yet-indexed records into new index segments.

    Readers then open only the files written since (about 1 ms each). The record files stay,
    nothing is removed (:func:`compact_ledger` removes them after a grace period); segments of
    processes indexing at once may overlap (records are read once, by ``record_id``). Returns
    the last new segment, or ``None`` when nothing was new.
    """
    folder = _ledger_folder(path, "index_ledger")
    written = compact_ledger(folder, grace=None)
    return written[-1] if written else None


def _unique_records(table: pa.Table) -> pa.Table:
    """Keep the first copy of every ``record_id`` (records without one are all kept)."""
    ids = table.column("record_id")
    if ids.null_count == 0 and len(pa.compute.unique(ids)) == len(ids):
        return table
    series = ids.to_pandas()
    duplicate = series.duplicated(keep="first") & series.notna()
    return table.filter(pa.array(~duplicate.to_numpy(dtype=bool)))


def _read_record_files(
    files: Sequence[Location], schema: pa.Schema, skipped: list[str], *, vanish: bool
) -> list[pa.Table]:
    tables = []
    for path in files:
        try:
            tables.append(_read_limited(path, LEDGER_RECORD_LIMITS, schema))
        except FileNotFoundError as err:
            if vanish:
                raise _VanishedError(str(path)) from None
            _skip(
                f"skipped unreadable file {path}: {type(err).__name__}: {err}",
                path,
                skipped,
                stacklevel=4,
            )
        except _OverLimitError as err:
            _skip(
                f"skipped oversized file {path}: {err} (not decoded)", path, skipped, stacklevel=4
            )
        except (OSError, pa.ArrowException, ValueError) as err:
            message = f"skipped unreadable file {path}: {type(err).__name__}: {err}"
            _skip(message, path, skipped, stacklevel=4)
    return tables


def read_ledger_table(
    path: PathLike,
    *,
    events: Sequence[str] | None = None,
    columns: Sequence[str] | None = None,
    skipped: list[str] | None = None,
) -> pa.Table:
    """Every record of a run ledger as an Arrow table, oldest first, each record once
    (:func:`read_ledger_records`); ``columns`` reads only those (``record_id``, ``written_at``
    and ``run_id`` always)."""
    if events is not None and not set(events) <= set(LEDGER_EVENTS):
        raise ValueError(f"events={events!r} is invalid; expected a subset of {LEDGER_EVENTS}.")
    schema = LEDGER_SCHEMA
    if columns is not None:
        unknown = sorted(set(columns) - set(LEDGER_SCHEMA.names))
        if unknown:
            raise ValueError(f"columns={unknown!r} are not ledger columns; valid: {schema.names}.")
        wanted = {"record_id", "written_at", "run_id", *columns, *(["event"] if events else [])}
        schema = pa.schema([f for f in LEDGER_SCHEMA if f.name in wanted])
    folder = _ledger_folder(path, "read_ledger_records")
    for attempt in range(_READ_TRIES):
        last = attempt == _READ_TRIES - 1
        found: list[str] = []
        try:
            table = _read_ledger_once(folder, schema, events, found, vanish=not last)
        except _VanishedError:
            continue  # a compactor moved records into a segment meanwhile: list again
        if skipped is not None:
            skipped.extend(found)
        return table
    raise AssertionError("unreachable")  # pragma: no cover - the last try never raises


def _read_ledger_once(
    folder: Location,
    schema: pa.Schema,
    events: Sequence[str] | None,
    skipped: list[str],
    *,
    vanish: bool,
) -> pa.Table:
    # Records first, then segments: a record compacted between the two listings is found in
    # its segment; one removed after both is found missing (_VanishedError) and the read restarts.
    files = _ledger_files(folder)
    segments = _read_segments(folder, schema, vanish=vanish, skipped=skipped)
    tables = [s.table for s in segments]
    pending = files
    if files and segments:
        named = pa.array([_record_id_of(f.name) for f in files], type=pa.string())
        held = pa.chunked_array([t.column("record_id") for t in tables], type=pa.string())
        covered = pa.compute.is_in(
            named, value_set=held.combine_chunks(), skip_nulls=True
        ).to_pylist()
        pending = [f for f, hit in zip(files, covered, strict=True) if not hit]
    if events is not None:
        # Names read <time>-<run_id>-<event>-<record_id>.parquet; ids are hex, so the event
        # word cannot occur inside them.
        pending = [f for f in pending if any(f"-{event}-" in f.name for event in events)]
        wanted = pa.array(list(events))
        tables = [t.filter(pa.compute.is_in(t.column("event"), value_set=wanted)) for t in tables]
    tables += _read_record_files(pending, schema, skipped, vanish=vanish)
    if not tables:
        return schema.empty_table()
    return _sorted_records(_unique_records(pa.concat_tables(tables).combine_chunks()))


def read_ledger_records(path: PathLike, *, events: Sequence[str] | None = None) -> pd.DataFrame:
    """Read every record of a run ledger, oldest first, each record once.

    ``path`` is the ledger folder or an output folder holding ``ledger/``; records held by
    index segments are read from them, the others from their files. ``events`` reads only
    those events (their file names say which). Skipped files are warned about and listed in
    ``attrs["skipped"]``. A compaction running meanwhile is tolerated (docs/ledger.md).
    """
    skipped: list[str] = []
    frame = _to_pandas(read_ledger_table(path, events=events, skipped=skipped))
    frame.attrs["skipped"] = skipped
    return frame


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    # Nullable dtypes keep "not measured" distinct from 0 and False.
    frame: pd.DataFrame = table.to_pandas(
        types_mapper={
            pa.int32(): pd.Int32Dtype(),
            pa.int64(): pd.Int64Dtype(),
            pa.bool_(): pd.BooleanDtype(),
            pa.float64(): pd.Float64Dtype(),
        }.get
    )
    return frame


def validate_phase_row(row: Mapping[str, Any]) -> None:
    """Check a phase row's columns and its ``phase``/``verdict``/``counter`` vocabulary."""
    _check_columns(row, PHASE_SCHEMA, "phase row")
    for column, vocabulary in (("phase", PHASES), ("verdict", VERDICTS), ("counter", COUNTERS)):
        value = row.get(column)
        if value is not None and value not in vocabulary:
            raise ValueError(f"row[{column!r}]={value!r} is invalid; expected one of {vocabulary}.")
    if row.get("phase") is None:
        raise ValueError(f"a phase row needs 'phase', one of {PHASES}.")
