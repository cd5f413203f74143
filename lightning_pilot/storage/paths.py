"""Safe names and locations: a name that becomes a path component, a local ``Path`` or a
:class:`RemotePath` on an fsspec filesystem, folders made with no symbolic link inside the
output folder (docs/architecture.md, "Storage rules"; docs/storage.md)."""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, TypeAlias, overload

from lightning_pilot.core import validate

if TYPE_CHECKING:
    from collections.abc import Iterator

    from fsspec import AbstractFileSystem  # type: ignore[import-untyped]

#: A local path (``str`` or ``os.PathLike``) or a :class:`RemotePath`.
PathLike: TypeAlias = "str | os.PathLike[str] | RemotePath"
#: Where a file or folder is: a local ``Path`` or a :class:`RemotePath`.
Location: TypeAlias = "Path | RemotePath"

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._+=@-]")
_MAX_COMPONENT = 128
_SAFE_COMPONENT = re.compile(rf"(?!\.)[A-Za-z0-9._+=@-]{{1,{_MAX_COMPONENT}}}")


def safe_path_component(value: object, argument: str) -> str:
    """Validate a name that becomes one component of a path: letters, digits and ``._+=@-``,
    no leading dot; return it unchanged (``argument`` names it in the error).

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
    return re.sub(r"^\.+", "_", cleaned) or fallback  # leading dots would hide the file


class UnsafePathError(OSError):
    """A folder lightning-pilot would write into is a symbolic link inside the output folder
    (which may itself be one); an ``OSError``, so it travels the paths of a full disk."""


#: ``scheme://`` at the start of a string: a URL for fsspec, not a local path.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: fsspec's local protocols, with or without ``//`` (Lightning writes ``file:///x`` as ``file:/x``).
_LOCAL_URL = re.compile(r"(?:file|local):")


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
        """Forget fsspec's cached listing: other processes write here too."""
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
        """Always ``False``: fsspec filesystems have no symbolic links here."""
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

    A local path becomes ``Path(value)``; ``file:`` and ``local:`` URLs (with or without
    ``//``) the local path fsspec, and so Lightning's checkpoints, would write (docs/storage.md,
    "A Trainer's root"). Any other ``scheme://`` URL is opened with fsspec, with
    ``storage_options`` or fsspec's configuration and the backend's environment (``AWS_*`` for
    s3fs). A chained URL (``simplecache::s3://...``) is refused.

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
    from fsspec.core import url_to_fs  # type: ignore[import-untyped]  # Lightning's dependency
    from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]

    try:
        fs, path = url_to_fs(value, **storage_options)
    except ImportError as err:
        raise ImportError(
            f"{value!r} needs the fsspec backend for its protocol: {err}. For s3:// install"
            " 'lightning-pilot[remote]' (s3fs)."
        ) from err
    return Path(path) if isinstance(fs, LocalFileSystem) else RemotePath(fs, path)


def _location_argument(owner: str, name: str, value: object, hint: str) -> Location:
    """``value`` checked as a folder argument (:func:`validate.path`), as a :func:`location`."""
    if isinstance(value, RemotePath):
        return value
    folder: Path = validate.path(owner, name, value, optional=False, hint=hint)
    return location(value) if isinstance(value, str) else folder


def work_folder(root: PathLike, *components: str) -> Path:
    """A local folder for files a library must write itself (checkpoints): ``root/components``
    when ``root`` is local, else one in the temporary directory named after the location."""
    base = location(root)
    return make_folder(base if isinstance(base, Path) else _remote_work_root(base), *components)


def _remote_work_root(base: RemotePath) -> Path:
    import hashlib
    import tempfile

    digest = hashlib.sha256(str(base).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"lightning-pilot-{digest}"


def remove_work_folder(root: PathLike) -> Path | None:
    """Remove the local folder :func:`work_folder` made for a remote ``root``; return it, or
    ``None`` when there was none (a local ``root`` keeps its work folders: they are part of the
    output folder). A folder that cannot be removed whole is a warning, never an error.

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
    """Join validated components to ``root`` for writing; ``root`` itself may be a link, but a
    link *inside* it, or a path resolving outside it, raises :class:`UnsafePathError`; a
    component that is not a safe name raises ``ValueError``."""
    base = location(root)
    for component in components:
        safe_path_component(component, "path component")
    if isinstance(base, RemotePath):
        return base.joinpath(*components)
    joined = base.joinpath(*components)
    for depth in range(1, len(components) + 1):
        _refuse_link(base.joinpath(*components[:depth]), base)
    resolved_root, resolved = base.resolve(), joined.resolve()
    if resolved != resolved_root and resolved_root not in resolved.parents:
        raise UnsafePathError(f"{joined} resolves to {resolved}, outside the output folder {base}.")
    return joined


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
