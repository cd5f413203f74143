"""Storage: atomic never-overwriting publish, tolerant readers, versioned schemas, safe names."""

from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_pilot import storage
from lightning_pilot.core.ids import new_run_id, validate_run_id
from lightning_pilot.ledger import Ledger
from lightning_pilot.storage import (
    LEDGER_SCHEMA,
    PHASE_SCHEMA,
    list_snapshot_files,
    publish_table,
    read_ledger_records,
    read_parquet_files,
    read_phase_table,
    rows_to_table,
    safe_join,
    safe_path_component,
    sanitize_name,
    write_ledger_record,
    write_snapshot,
)

WORKER = Path(__file__).parent / "workers" / "ledger_writer.py"


def _hidden(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if p.name.startswith(".")]


# ------------------------------------------------------------------------------------------
# publish
# ------------------------------------------------------------------------------------------


def test_publish_never_overwrites_and_leaves_no_temp(tmp_path: Path) -> None:
    path = publish_table(pa.table({"x": [1, 2, 3]}), tmp_path / "sub" / "a.parquet")
    with pytest.raises(FileExistsError, match=r"refusing to overwrite .*a\.parquet"):
        publish_table(pa.table({"x": [9]}), path)
    assert pq.read_table(path).column("x").to_pylist() == [1, 2, 3]
    assert _hidden(tmp_path) == []


def test_publish_refuses_hidden_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"names a hidden file"):
        publish_table(pa.table({"x": [1]}), tmp_path / ".secret.parquet")


def test_disk_full_during_publish_leaves_nothing_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = publish_table(pa.table({"x": [1]}), tmp_path / "good.parquet")
    real_write = pq.write_table

    def half_write_then_fail(table: pa.Table, where: object, **kwargs: object) -> None:
        real_write(table.slice(0, 1), where)  # some bytes reach the temp file first
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pq, "write_table", half_write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        publish_table(pa.table({"x": [1, 2]}), tmp_path / "bad.parquet")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.parquet"]
    assert read_parquet_files([good]).num_rows == 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_failed_clean_up_never_masks_the_write_error(tmp_path: Path, code: int) -> None:
    # The write fails (a full disk, a read-only remount) and then so does removing the
    # temporary file (here: something replaced it by a folder): the caller must see the first
    # error, the one that says what went wrong.
    def fail(handle: BinaryIO) -> None:
        handle.write(b"partial")
        tmp = Path(handle.name)
        tmp.unlink()
        tmp.mkdir()
        raise OSError(code, os.strerror(code))

    with pytest.raises(OSError, match=os.strerror(code)) as caught:
        storage.publish_file(tmp_path / "a.parquet", fail)
    assert caught.value.errno == code
    assert not (tmp_path / "a.parquet").exists()
    if sys.version_info >= (3, 11):
        assert any("could not remove the temporary file" in n for n in caught.value.__notes__)
    for leftover in tmp_path.iterdir():  # the folder that took the temporary file's place
        leftover.rmdir()


@pytest.fixture(scope="module")
def eight_writers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Eight processes publish 50 ledger records each into one folder, all at once, with run
    ids made in the same millisecond, and each indexes the ledger after every 10 records and
    at its end while the others write and index. Shared: the folder and the ids they printed."""
    tmp_path = tmp_path_factory.mktemp("eight-writers")
    ledger = tmp_path / "ledger"
    same_ms = time.time_ns()
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(ledger), str(w), "50", str(go), str(same_ms), "10"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for w in range(8)
    ]
    for proc in procs:  # every worker has imported everything and waits
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    go.touch()  # all eight publish (and index) at once
    run_ids: list[str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        run_ids.extend(out.split())
    return ledger, run_ids


def test_eight_processes_publish_400_records_concurrently(
    eight_writers: tuple[Path, list[str]],
) -> None:
    ledger, run_ids = eight_writers
    # Ids made in the same millisecond by eight processes never collide.
    assert len(run_ids) == 400
    assert len(set(run_ids)) == 400
    files = [p for p in ledger.iterdir() if p.name != "_index"]
    assert len(files) == 400
    assert _hidden(ledger) == []
    records = read_ledger_records(ledger.parent)
    assert len(records) == 400
    assert set(records["run_id"]) == set(run_ids)
    assert records.groupby("variant").size().to_dict() == {f"worker-{w}": 50 for w in range(8)}


@pytest.mark.slow
def test_eight_processes_writing_and_indexing_at_once_lose_and_duplicate_nothing(
    eight_writers: tuple[Path, list[str]],
) -> None:
    ledger, run_ids = eight_writers
    segments = list((ledger / "_index").glob("segment-*.parquet"))
    assert len(segments) >= 8  # every worker indexed

    records = read_ledger_records(ledger)
    assert records["record_id"].is_unique
    assert sorted(records["run_id"]) == sorted(run_ids)
    runs = Ledger(ledger).runs()
    assert len(runs) == 8 * 50
    assert set(runs["records"]) == {1}


# ------------------------------------------------------------------------------------------
# tolerant readers and schema versions
# ------------------------------------------------------------------------------------------


def _record(**extra: object) -> dict[str, object]:
    return {"run_id": new_run_id(), "event": "start", "status": "running", **extra}


def test_truncated_file_is_skipped_with_a_warning_naming_it(tmp_path: Path) -> None:
    for seed in range(3):
        write_ledger_record(tmp_path, _record(seed=seed))
    victim = sorted(tmp_path.iterdir())[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.parquet").write_bytes(b"not parquet at all")

    with pytest.warns(RuntimeWarning, match=r"skipped unreadable file .*") as caught:
        records = read_ledger_records(tmp_path)
    named = " ".join(str(w.message) for w in caught)
    assert victim.name in named
    assert "garbage.parquet" in named
    assert len(records) == 2
    assert sorted(records["seed"].tolist()) == sorted({0, 1, 2} - {_seed_of(data)})


def _seed_of(data: bytes) -> int:
    return int(pq.read_table(pa.BufferReader(data)).column("seed")[0].as_py())


def test_older_schema_reads_with_nulls_in_newer_columns(tmp_path: Path) -> None:
    # A version-0 ledger file knew only a few columns, with narrower integer types.
    old = pa.table(
        {
            "schema_version": pa.array([0], pa.int32()),
            "record_id": [new_run_id()],
            "event": ["end"],
            "run_id": [new_run_id()],
            "status": ["diverged"],
            "stop_step": pa.array([17], pa.int32()),
        }
    )
    publish_table(old, tmp_path / "old.parquet")
    write_ledger_record(tmp_path, _record(tokens_seen=1234, lr=1e-4))

    records = read_ledger_records(tmp_path)
    assert list(records.columns) == LEDGER_SCHEMA.names
    old_row = records[records["schema_version"] == 0].iloc[0]
    assert old_row["status"] == "diverged"
    assert old_row["stop_step"] == 17
    assert pd.isna(old_row["tokens_seen"])  # a newer column: null, never 0
    assert pd.isna(old_row["lr"])
    new_row = records[records["schema_version"] == storage.LEDGER_SCHEMA_VERSION].iloc[0]
    assert new_row["tokens_seen"] == 1234


def test_incompatible_column_type_skips_that_file(tmp_path: Path) -> None:
    publish_table(
        pa.table({"run_id": [new_run_id()], "stop_step": ["seventeen"]}), tmp_path / "x.parquet"
    )
    write_ledger_record(tmp_path, _record())
    with pytest.warns(RuntimeWarning, match=r"x\.parquet.*stop_step"):
        records = read_ledger_records(tmp_path)
    assert len(records) == 1


def test_phase_table_nulls_stay_null_not_zero(tmp_path: Path) -> None:
    row = {"run_id": new_run_id(), "attempt": 1, "rank": 0, "phase": "forward", "counter": "none"}
    write_snapshot(
        tmp_path / "runs" / "r" / "phases.parquet",
        rows_to_table([row], PHASE_SCHEMA),
        writer="w",
        seq=1,
    )
    frame = read_phase_table(tmp_path)
    assert frame.loc[0, "counter"] == "none"
    assert pd.isna(frame.loc[0, "peak_allocated_bytes"])
    assert str(frame["peak_allocated_bytes"].dtype) == "Int64"


def test_rows_to_table_names_the_bad_column() -> None:
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['peak_bytes'\]"):
        rows_to_table([{"phase": "forward", "peak_bytes": 3}], PHASE_SCHEMA)
    with pytest.raises(ValueError, match=r"column 'occurrences' expects int64"):
        rows_to_table([{"phase": "forward", "occurrences": "many"}], PHASE_SCHEMA)


def test_ledger_record_validation(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"record\['event'\]='finish'\) is invalid: expected one of"
    ):
        write_ledger_record(tmp_path, {"run_id": new_run_id(), "event": "finish"})
    with pytest.raises(ValueError, match=r"record\['status'\]='ok'\) is invalid: expected one of"):
        write_ledger_record(tmp_path, _record(status="ok"))
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['colour'\]"):
        write_ledger_record(tmp_path, _record(colour="red"))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------
# snapshots
# ------------------------------------------------------------------------------------------


def test_snapshots_newest_per_writer_wins(tmp_path: Path) -> None:
    folder = tmp_path / "t.parquet"
    write_snapshot(folder, pa.table({"v": [1]}), writer="a", seq=1)
    write_snapshot(folder, pa.table({"v": [1, 2]}), writer="a", seq=2)
    write_snapshot(folder, pa.table({"v": [10]}), writer="b", seq=1)
    # The superseded snapshot is removed, so a plain pandas read sees every row once.
    assert sorted(pd.read_parquet(folder)["v"].tolist()) == [1, 2, 10]
    # A crash between publish and clean-up leaves an older snapshot: readers ignore it.
    publish_table(
        pa.table({"v": [1]}).replace_schema_metadata(
            {storage.tables.SNAPSHOT_METADATA_KEY: b'{"writer": "a", "seq": 1}'}
        ),
        folder / "part-a-00000001.parquet",
    )
    newest = list_snapshot_files(folder)
    assert [p.name for p in newest] == ["part-a-00000002.parquet", "part-b-00000001.parquet"]
    assert sorted(storage.read_snapshot_table(folder).column("v").to_pylist()) == [1, 2, 10]


def test_read_phase_table_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        read_phase_table(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"holds no phase table"):
        read_phase_table(tmp_path)


# ------------------------------------------------------------------------------------------
# names that become paths
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "../x",
        "..",
        ".",
        "/etc/passwd",
        "a/b",
        "a\\b",
        "a\x00b",
        "",
        ".hidden",
        "x" * 129,
        "a b",
        "~root",
    ],
)
def test_unsafe_names_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match=r"variant=.* is not a safe name"):
        safe_path_component(name, "variant")


def test_non_string_name_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"variant must be a string, got int 3"):
        safe_path_component(3, "variant")


@pytest.mark.parametrize(
    "text", ["../../etc/passwd", "/abs/path", "a\x00b", "..", "lr=1e-4 / warm"]
)
def test_sanitized_names_stay_inside_the_folder(tmp_path: Path, text: str) -> None:
    name = sanitize_name(text)
    assert safe_path_component(name, "name") == name
    assert safe_join(tmp_path, "runs", name).parent == tmp_path / "runs"


def test_safe_join_refuses_a_symlink_out(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(storage.UnsafePathError, match=r"link is a symbolic link"):
        safe_join(root, "link", "x")


def _linked_out_dir(tmp_path: Path, component: str, *, inside: bool = False) -> tuple[Path, Path]:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = out_dir / "elsewhere" if inside else tmp_path / "outside"
    target.mkdir()
    (out_dir / component).symlink_to(target, target_is_directory=True)
    return out_dir, target


@pytest.mark.parametrize("inside", [False, True])
def test_a_symlinked_ledger_folder_is_refused_for_writes(tmp_path: Path, inside: bool) -> None:
    out_dir, target = _linked_out_dir(tmp_path, "ledger", inside=inside)
    record = {"run_id": new_run_id(), "event": "start", "status": "running"}
    with pytest.raises(storage.UnsafePathError, match=r"out/ledger is a symbolic link") as caught:
        write_ledger_record(out_dir / "ledger", record)
    assert isinstance(caught.value, OSError)  # handled like a folder the pilot cannot write
    assert list(target.iterdir()) == []  # nothing written through the link
    with pytest.raises(storage.UnsafePathError, match=r"symbolic link"):
        storage.index_ledger(out_dir / "ledger")


@pytest.mark.parametrize("inside", [False, True])
def test_a_symlinked_runs_folder_is_refused_like_the_ledger(tmp_path: Path, inside: bool) -> None:
    out_dir, target = _linked_out_dir(tmp_path, "runs", inside=inside)
    with pytest.raises(storage.UnsafePathError, match=r"out/runs is a symbolic link"):
        safe_join(out_dir, "runs", new_run_id())
    assert list(target.iterdir()) == []


def test_a_symlinked_table_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    run_dir = tmp_path / "out" / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "phases.parquet").symlink_to(outside, target_is_directory=True)
    with pytest.raises(storage.UnsafePathError, match=r"phases\.parquet is a symbolic link"):
        write_snapshot(run_dir / "phases.parquet", pa.table({"x": [1]}), writer="w", seq=1)
    assert list(outside.iterdir()) == []


def test_an_output_folder_that_is_itself_a_link_is_fine(tmp_path: Path) -> None:
    # Shared storage mounted through a link: out_dir is resolved once, links inside it refused.
    shared = tmp_path / "shared"
    shared.mkdir()
    out_dir = tmp_path / "pilot"
    out_dir.symlink_to(shared, target_is_directory=True)
    run_id = new_run_id()
    assert safe_join(out_dir, "runs", run_id) == out_dir / "runs" / run_id
    write_ledger_record(out_dir / "ledger", {"run_id": run_id, "event": "start"})
    assert storage.index_ledger(out_dir / "ledger") is not None
    write_snapshot(out_dir / "runs" / run_id / "phases.parquet", pa.table({"x": [1]}),
                   writer="w", seq=1)  # fmt: skip
    assert len(read_ledger_records(shared)) == 1
    assert (shared / "runs" / run_id / "phases.parquet").is_dir()


@pytest.mark.parametrize(
    "value", ["../../etc", "20261130T080512123Z-xyz", "20261130T080512123Z-0123456789abcdef/.."]
)
def test_bad_run_ids_are_rejected(value: str) -> None:
    with pytest.raises(ValueError, match=r"is not a run id"):
        validate_run_id(value, "run_id")
    with pytest.raises(ValueError, match=r"is not a run id"):
        write_ledger_record(Path("/nonexistent"), {"run_id": value, "event": "start"})


def test_run_ids_sort_by_time() -> None:
    early = new_run_id(now_ns=1_700_000_000_000_000_000)
    late = new_run_id(now_ns=1_700_000_000_001_000_000)  # one millisecond later
    assert early < late
    assert early.startswith("20231114T221320000Z-")


# ------------------------------------------------------------------------------------------
# the ledger index: a derived copy that speeds reading and never replaces a record
# ------------------------------------------------------------------------------------------


def test_index_speeds_reading_without_touching_records(tmp_path: Path) -> None:
    for seed in range(5):
        write_ledger_record(tmp_path, _record(seed=seed))
    files_before = sorted(p.name for p in tmp_path.glob("*.parquet"))
    segment = storage.index_ledger(tmp_path)
    assert segment is not None
    assert segment.parent.name == "_index"
    assert storage.index_ledger(tmp_path) is None  # nothing new to index
    write_ledger_record(tmp_path, _record(seed=5))  # written after the index
    records = read_ledger_records(tmp_path)
    assert sorted(records["seed"].tolist()) == [0, 1, 2, 3, 4, 5]
    assert records["record_id"].is_unique
    # Every record file is still there, and pandas does not see the index twice.
    assert sorted(p.name for p in tmp_path.glob("*.parquet"))[:5] == files_before
    assert len(pd.read_parquet(tmp_path)) == 6


def test_damaged_index_falls_back_to_the_record_files(tmp_path: Path) -> None:
    for seed in range(3):
        write_ledger_record(tmp_path, _record(seed=seed))
    segment = storage.index_ledger(tmp_path)
    assert segment is not None
    segment.write_bytes(segment.read_bytes()[:40])
    with pytest.warns(RuntimeWarning, match=r"skipped unreadable ledger index .*segment-"):
        records = read_ledger_records(tmp_path)
    assert sorted(records["seed"].tolist()) == [0, 1, 2]


def test_reading_only_some_events_uses_file_names_and_the_index(tmp_path: Path) -> None:
    run_id = new_run_id()
    for event, status in (("start", "running"), ("heartbeat", "running"), ("end", "completed")):
        write_ledger_record(tmp_path, {"run_id": run_id, "event": event, "status": status})
    storage.index_ledger(tmp_path)
    write_ledger_record(tmp_path, {"run_id": new_run_id(), "event": "end", "status": "failed"})
    ends = read_ledger_records(tmp_path, events=("end",))
    assert sorted(ends["status"].tolist()) == ["completed", "failed"]
    with pytest.raises(ValueError, match=r"events=\('stop',\) is invalid"):
        read_ledger_records(tmp_path, events=("stop",))


def test_index_segments_are_cut_within_their_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A backlog larger than one segment may hold is cut into several (3 records each here; 10,000
    # in real use, well inside LEDGER_SEGMENT_LIMITS), and every record still reads once.
    cut = storage.ledger_store._SEGMENT_CUT
    monkeypatch.setattr(storage.ledger_store, "_SEGMENT_CUT", (3, *cut[1:]))
    for seed in range(7):
        write_ledger_record(tmp_path, _record(seed=seed))
    last = storage.index_ledger(tmp_path)
    assert last is not None
    segments = sorted((tmp_path / "_index").glob("segment-*.parquet"))
    assert sorted(pq.ParquetFile(s).metadata.num_rows for s in segments) == [1, 3, 3]
    assert storage.index_ledger(tmp_path) is None
    assert sorted(read_ledger_records(tmp_path)["seed"]) == list(range(7))


def test_a_derived_file_is_replaced_on_purpose_and_a_table_never(tmp_path: Path) -> None:
    path = tmp_path / "plots" / "loss.png"
    storage.publish_file(path, lambda handle: handle.write(b"first"), replace=True)
    storage.publish_file(path, lambda handle: handle.write(b"second"), replace=True)
    assert path.read_bytes() == b"second"
    assert [p.name for p in path.parent.iterdir()] == ["loss.png"]  # no temporary left
    with pytest.raises(FileExistsError):
        storage.publish_file(path, lambda handle: handle.write(b"third"))


def test_reserve_file_holds_the_space_once(tmp_path: Path) -> None:
    path = tmp_path / ".reserve-test"
    assert storage.publish.reserve_file(path, 1 << 20) is True  # Linux: posix_fallocate
    assert path.stat().st_size == 1 << 20
    assert storage.publish.reserve_file(path, 1 << 20) is False  # never over an existing file


# -- Locations: local paths stay local, URLs go through fsspec (docs/storage.md) -------------


def test_location_keeps_local_paths_and_opens_urls(tmp_path: Path) -> None:
    assert storage.location(str(tmp_path)) == tmp_path
    assert storage.location(tmp_path / "x") == tmp_path / "x"
    assert storage.location(f"file://{tmp_path}/x") == tmp_path / "x"
    # An os.PathLike is always local, whatever it spells: Path("s3://b") is "s3:/b".
    assert storage.location(Path("s3://bucket")) == Path("s3:/bucket")
    remote = storage.location("memory://loc-test/out")
    assert isinstance(remote, storage.RemotePath)
    assert str(remote / "ledger") == "memory:///loc-test/out/ledger"
    assert (remote / "ledger").parent == remote
    assert storage.is_remote("s3://bucket/x")
    assert not storage.is_remote(str(tmp_path))
    with pytest.raises(ValueError, match="chained fsspec URL"):
        storage.location("simplecache::memory://loc-test/out")


def test_a_remote_path_is_never_a_local_file(tmp_path: Path) -> None:
    remote = storage.location("memory://loc-test/never-local")
    with pytest.raises(TypeError):
        open(remote, "wb")  # type: ignore[call-overload]  # noqa: SIM115
    with pytest.raises(TypeError):
        os.fspath(remote)  # type: ignore[call-overload]
    # Files a library must write itself go to a local folder named after the remote one.
    work = storage.work_folder(remote, "resume")
    assert work.is_dir()
    assert work == storage.work_folder("memory://loc-test/never-local", "resume")
    assert work.parent.name.startswith("lightning-pilot-")
    assert storage.work_folder(tmp_path, "resume") == tmp_path / "resume"
    with pytest.raises(ValueError, match="not a safe name"):
        storage.work_folder(remote, "..")
    # Removed whole once the run is done with it; a local run's work folder is output: kept.
    (work / "probe.ckpt").write_bytes(b"checkpoint")
    assert storage.remove_work_folder(remote) == work.parent
    assert not work.parent.exists()
    assert storage.remove_work_folder(tmp_path) is None
    assert (tmp_path / "resume").is_dir()


def test_memory_location_publishes_once_and_reads_back() -> None:
    out = storage.location(f"memory://loc-{new_run_id()}/out")
    table = storage.rows_to_table(
        [{"run_id": new_run_id(), "phase": "forward", "verdict": "pass"}],
        storage.PHASE_SCHEMA,
    )
    folder = storage.make_folder(out, "runs", str(table["run_id"][0]), "phases.parquet")
    first = storage.write_snapshot(folder, table, writer="a0001-r00000-x", seq=1)
    second = storage.write_snapshot(folder, table, writer="a0001-r00000-x", seq=2)
    assert [path.name for path in folder.iterdir()] == [second.name]  # the older one removed
    assert not first.exists()
    frame = storage.read_phase_table(str(out))
    assert frame["phase"].tolist() == ["forward"]
    assert frame.attrs["skipped"] == []
    with pytest.raises(FileExistsError, match="refusing to overwrite memory://"):
        storage.publish_table(table, second)
    with pytest.raises(ValueError, match="hidden file"):
        storage.publish_bytes(b"x", out / ".hidden")
    # A damaged file on the remote side is skipped with a warning, as on a disk.
    storage.publish_bytes(b"not parquet", folder / "part-zz-00000001.parquet")
    with pytest.warns(storage.SkippedFileWarning, match="part-zz-00000001"):
        frame = storage.read_phase_table(out)
    assert len(frame) == 1
    assert frame.attrs["skipped"] == [str(folder / "part-zz-00000001.parquet")]


def test_a_refused_publish_reaches_every_publisher_and_the_ledger_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # storage is a package of modules: publish_json and write_ledger_record publish through
    # storage.publish.publish_file, and the ledger writer reads its limits from ledger_store.
    refused: list[str] = []

    def refuse(path: object, write: object, *, replace: bool = False) -> Path:
        refused.append(str(path))
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    real = storage.publish_file
    for where in (storage, storage.publish):  # callers of storage.publish_file; the publishers
        monkeypatch.setattr(where, "publish_file", refuse)
    for publish in (
        lambda: storage.publish_json({"ok": True}, tmp_path / "result.json"),
        lambda: write_ledger_record(tmp_path, _record(seed=1)),
    ):
        with pytest.raises(OSError, match="No space left"):
            publish()
    assert [Path(path).suffix for path in refused] == [".json", ".parquet"]
    limits = storage.LEDGER_RECORD_LIMITS
    smaller = dataclasses.replace(limits, max_rows=0)
    monkeypatch.setattr(storage.ledger_store, "LEDGER_RECORD_LIMITS", smaller)
    with pytest.raises(ValueError, match=r"1 rows > LEDGER_RECORD_LIMITS.max_rows=0"):
        write_ledger_record(tmp_path, _record(seed=2))
    monkeypatch.undo()
    assert storage.publish.publish_file is real
    assert storage.ledger_store.LEDGER_RECORD_LIMITS is limits
    assert storage.publish_json({"ok": True}, tmp_path / "result.json").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "result.json"]
    # The public classes keep their public name: in tracebacks, reprs and pickles.
    assert storage.UnsafePathError.__module__ == "lightning_pilot.storage"
    remote = storage.location("memory://pickle-test/out")
    assert pickle.loads(pickle.dumps(remote)) == remote
