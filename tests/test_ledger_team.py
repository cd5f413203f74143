"""A ledger for a whole team: many writers and compactors at once, on a disk or an fsspec
location, read by `Ledger` and by DuckDB and Polars (docs/ledger.md, "A ledger for a whole
team")."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_pilot import storage
from lightning_pilot.core.ids import new_run_id
from lightning_pilot.ledger import Ledger
from lightning_pilot.storage import (
    LEDGER_SCHEMA,
    SkippedFileWarning,
    compact_ledger,
    index_ledger,
    read_ledger_records,
    write_ledger_record,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "ledger.md"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
STATUSES = ("completed", "diverged", "failed", "stopped")

WRITER = """
import sys, time
from pathlib import Path
from lightning_pilot.core.ids import new_run_id
from lightning_pilot.storage import write_ledger_record
folder, worker, runs, go = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
for index in range(runs):
    run = {"run_id": new_run_id(), "experiment": "team", "variant": f"w{worker}", "seed": index}
    curve = [{"step": s, "value": 1.0 / s} for s in range(1, 9)]
    for event, extra in (
        ("start", {"status": "running"}),
        ("heartbeat", {"status": "running", "curves_delta": True, "train_loss": curve[:4]}),
        ("end", {"status": "completed", "updates_done": 8, "train_loss": curve}),
    ):
        path = write_ledger_record(folder, {**run, "event": event, **extra})
        print(path.name.rsplit("-", 2)[-2] + "-" + path.name.rsplit("-", 1)[-1][:-8], flush=True)
"""

COMPACTOR = """
import sys, time, warnings
from pathlib import Path
from lightning_pilot.storage import SkippedFileWarning, compact_ledger
warnings.simplefilter("error", SkippedFileWarning)
folder, stop, grace = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
print("ready", flush=True)
rounds = 0
while not stop.exists():
    compact_ledger(folder, grace=grace)
    rounds += 1
print(rounds, flush=True)
"""

READER = """
import sys, warnings
from pathlib import Path
from lightning_pilot.storage import SkippedFileWarning, read_ledger_table
warnings.simplefilter("error", SkippedFileWarning)
folder, stop = Path(sys.argv[1]), Path(sys.argv[2])
print("ready", flush=True)
seen, reads = set(), 0
while not stop.exists():
    ids = read_ledger_table(folder, columns=["record_id"]).column("record_id").to_pylist()
    assert len(ids) == len(set(ids)), "a record read twice"
    lost = seen - set(ids)
    assert not lost, f"{len(lost)} record(s) seen before are missing: {sorted(lost)[:3]}"
    seen, reads = set(ids), reads + 1
print(reads, len(seen), flush=True)
"""


def _start(code: str, *args: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.stderr and proc.stderr.read()
    return proc


def _finish(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out


def _record_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.parquet"))


def _segments(folder: Path) -> list[Path]:
    return sorted((folder / "_index").glob("segment-*.parquet"))


def _write_runs(folder: Any, runs: int, *, end: bool = True) -> list[str]:
    """``runs`` runs of start, heartbeat (a curve delta) and end records; the record ids."""
    ids = []
    for index in range(runs):
        run = {"run_id": new_run_id(), "experiment": "e", "variant": f"v{index % 3}", "seed": index}
        curve = [{"step": s, "value": float(index + s)} for s in range(1, 5)]
        events = [
            ("start", {"status": "running"}),
            ("heartbeat", {"status": "running", "curves_delta": True, "train_loss": curve[:2]}),
        ]
        if end:
            status = STATUSES[index % len(STATUSES)]
            events.append(("end", {"status": status, "updates_done": 4, "train_loss": curve}))
        for event, extra in events:
            record_id = new_run_id()
            write_ledger_record(folder, {**run, "event": event, "record_id": record_id, **extra})
            ids.append(record_id)
    return ids


def _quiet_runs(path: Any) -> pd.DataFrame:
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedFileWarning)
        return Ledger(path).runs()


# ------------------------------------------------------------------------------------------
# 1. eight writers, two compactors that remove at once and a reader, all at the same time
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_eight_writers_two_compactors_and_a_reader_lose_and_duplicate_nothing(
    tmp_path: Path,
) -> None:
    folder, go, stop = tmp_path / "ledger", tmp_path / "go", tmp_path / "stop"
    folder.mkdir()
    write_ledger_record(folder, {"run_id": new_run_id(), "event": "start", "status": "running"})
    writers = [_start(WRITER, folder, w, 25, go) for w in range(8)]
    # grace=0: a compactor removes record files and merged segments the moment a segment
    # holds them, the hardest case for readers (the default keeps them an hour).
    compactors = [_start(COMPACTOR, folder, stop, 0) for _ in range(2)]
    reader = _start(READER, folder, stop)
    go.touch()
    written = [line for w in writers for line in _finish(w).split()]
    stop.touch()
    rounds = [int(_finish(c)) for c in compactors]
    reads, last_seen = map(int, _finish(reader).split())

    assert len(written) == 8 * 25 * 3
    assert len(set(written)) == len(written)
    assert min(rounds) >= 2
    assert reads >= 2
    assert last_seen >= 1
    records = read_ledger_records(folder)
    assert records["record_id"].is_unique
    assert set(written) <= set(records["record_id"])
    assert len(records) == len(written) + 1
    runs = _quiet_runs(folder)
    team = runs[runs["experiment"] == "team"]
    assert len(team) == 200
    assert set(team["status"]) == {"completed"}
    assert set(team["records"]) == {3}
    assert team.groupby("variant").size().to_dict() == {f"w{w}": 25 for w in range(8)}
    curves = Ledger(folder).curves()
    assert len(curves[curves["curve"] == "train_loss"]) == 200 * 8
    # One more compaction after everyone stopped: every record file is in a segment and gone.
    compact_ledger(folder, grace=0)
    assert _record_files(folder) == []
    assert read_ledger_records(folder)["record_id"].tolist() == records["record_id"].tolist()


# ------------------------------------------------------------------------------------------
# 2. a compaction caught half-way
# ------------------------------------------------------------------------------------------


def test_segment_published_but_record_files_not_yet_removed_reads_each_record_once(
    tmp_path: Path,
) -> None:
    ids = _write_runs(tmp_path, 4)
    # index_ledger publishes segments and removes nothing: the state of a compactor killed
    # between its publish and its removals.
    assert index_ledger(tmp_path) is not None
    assert len(_record_files(tmp_path)) == len(ids)
    records = read_ledger_records(tmp_path)
    assert sorted(records["record_id"]) == sorted(ids)
    # ... and two compactors that merged the same segments at once: the records in three
    # segments, and still in their files.
    (segment,) = _segments(tmp_path)
    for copy in ("segment-20000101T000000000000Z-copy1.parquet", "segment-copy2.parquet"):
        (tmp_path / "_index" / copy).write_bytes(segment.read_bytes())
    again = read_ledger_records(tmp_path)
    assert again["record_id"].tolist() == records["record_id"].tolist()
    assert _quiet_runs(tmp_path)["records"].tolist() == [3, 3, 3, 3]


def test_a_compactor_killed_at_any_point_leaves_every_record_readable_once(
    tmp_path: Path,
) -> None:
    ids = _write_runs(tmp_path, 200)  # 600 record files
    code = (
        "import sys; from lightning_pilot.storage import compact_ledger;"
        " print('ready', flush=True); compact_ledger(sys.argv[1], grace=0)"
    )
    killed_at = []
    for delay in (0.3, 0.8, 1.5):
        proc = _start(code, tmp_path)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        killed_at.append((len(_record_files(tmp_path)), len(_segments(tmp_path))))
        records = read_ledger_records(tmp_path)
        assert sorted(records["record_id"]) == sorted(ids), killed_at
    # Whatever was left (hidden temporary files of an interrupted publish included), the next
    # compaction completes it.
    compact_ledger(tmp_path, grace=0)
    assert _record_files(tmp_path) == []
    assert sorted(read_ledger_records(tmp_path)["record_id"]) == sorted(ids)
    assert len(_quiet_runs(tmp_path)) == 200


def test_a_record_file_removed_after_the_reader_listed_it_is_found_in_its_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _write_runs(tmp_path, 3)
    listed = storage.ledger_store._ledger_files(tmp_path)
    original = storage.ledger_store._read_segments
    calls = []

    def compact_between(folder: Any, schema: pa.Schema, **options: Any) -> Any:
        # The reader has listed the record files; a compactor now runs to the end (grace=0),
        # but this reader still lists no segment: its record files have vanished when read.
        calls.append(options)
        if len(calls) == 1:
            with monkeypatch.context() as inner:
                inner.setattr(storage.ledger_store, "_read_segments", original)
                compact_ledger(folder, grace=0)
            return []
        return original(folder, schema, **options)

    monkeypatch.setattr(storage.ledger_store, "_read_segments", compact_between)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedFileWarning)
        records = read_ledger_records(tmp_path)
    assert len(calls) >= 2  # the read was started again, listing afresh
    assert sorted(records["record_id"]) == sorted(ids)
    assert all(not p.exists() for p in listed)


# ------------------------------------------------------------------------------------------
# 3. compaction: what it removes, and when
# ------------------------------------------------------------------------------------------


def test_compaction_removes_only_what_a_settled_segment_holds(tmp_path: Path) -> None:
    ids: list[str] = []
    for _ in range(3):
        ids += _write_runs(tmp_path, 2)
        index_ledger(tmp_path)
    ids += _write_runs(tmp_path, 2)
    small = _segments(tmp_path)
    assert len(small) == 3
    # Default grace (an hour): the small segments and the new records (four batches: enough to
    # merge) become one new segment; nothing is removed, since none holding them is an hour old.
    (merged,) = compact_ledger(tmp_path)
    assert len(pq.read_table(merged)) == len(ids)
    assert len(_record_files(tmp_path)) == len(ids)
    assert _segments(tmp_path) == sorted([*small, merged])
    # A second compaction does not merge what the merged segment already holds.
    assert compact_ledger(tmp_path) == []
    # Once the merged segment has settled (grace=0 here), the record files and the small
    # segments it holds are removed; the merged segment, the only copy, stays.
    assert compact_ledger(tmp_path, grace=0) == []
    assert _record_files(tmp_path) == []
    assert _segments(tmp_path) == [merged]
    assert sorted(read_ledger_records(tmp_path)["record_id"]) == sorted(ids)
    # Records written after it are read from their files, then compacted in turn into a
    # segment of their own (two small segments are not worth a merge yet).
    later = _write_runs(tmp_path, 1)
    assert len(read_ledger_records(tmp_path)) == len(ids) + len(later)
    (newest,) = compact_ledger(tmp_path, grace=0)
    assert _record_files(tmp_path) == []
    assert _segments(tmp_path) == sorted([merged, newest])
    assert len(read_ledger_records(tmp_path)) == len(ids) + len(later)


def test_compaction_keeps_what_it_cannot_read_and_readers_still_name_it(tmp_path: Path) -> None:
    ids = _write_runs(tmp_path, 2)
    damaged = tmp_path / f"20990101T000000000000Z-{new_run_id()}-end-{new_run_id()}.parquet"
    damaged.write_bytes(b"PAR1 not really")
    compact_ledger(tmp_path, grace=0)
    assert _record_files(tmp_path) == [damaged]  # never removed: no segment holds it
    with pytest.warns(SkippedFileWarning, match=re.escape(damaged.name)):
        records = read_ledger_records(tmp_path)
    assert sorted(records["record_id"]) == sorted(ids)
    assert records.attrs["skipped"] == [str(damaged)]


def test_compaction_joins_what_it_reads_in_batches_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Record files are joined a few thousand at a time (each read table alone carries about
    # 75 KB of Arrow objects: 290,000 held apart took 22 GB). Batches of 4 over 3 x 3 records
    # plus one unreadable file: a batch boundary inside, a short last batch, a skipped file.
    monkeypatch.setattr(storage.ledger_store, "_PENDING_JOIN", 4)
    ids = _write_runs(tmp_path, 3)
    damaged = tmp_path / f"20990101T000000000000Z-{new_run_id()}-end-{new_run_id()}.parquet"
    damaged.write_bytes(b"PAR1 not really")
    compact_ledger(tmp_path, grace=0)
    assert _record_files(tmp_path) == [damaged]
    held = pa.concat_tables([pq.read_table(segment) for segment in _segments(tmp_path)])
    assert sorted(held.column("record_id").to_pylist()) == sorted(ids)
    with pytest.warns(SkippedFileWarning):
        assert sorted(read_ledger_records(tmp_path)["record_id"]) == sorted(ids)


def test_a_damaged_segment_is_listed_as_skipped_and_show_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_pilot.cli import main

    lost = _write_runs(tmp_path, 2)
    (first,) = compact_ledger(tmp_path, grace=0)  # the record files are gone: the only copy
    kept = _write_runs(tmp_path, 1)
    (second,) = compact_ledger(tmp_path, grace=0)
    assert _record_files(tmp_path) == []
    first.write_bytes(first.read_bytes()[:100])  # damaged after the fact (a bad disk, say)
    with pytest.warns(
        SkippedFileWarning, match=rf"unreadable ledger index {re.escape(str(first))}"
    ):
        records = read_ledger_records(tmp_path)
    assert sorted(records["record_id"]) == sorted(kept)  # its 6 records are read nowhere else
    assert records.attrs["skipped"] == [str(first)]
    ledger = Ledger(tmp_path)
    with pytest.warns(SkippedFileWarning):
        assert ledger.runs().attrs["skipped"] == [str(first)]
    assert ledger.skipped == [str(first)]
    # The command line will not claim a clean result on a ledger it could not read whole.
    capsys.readouterr()
    assert main(["show", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not everything in scope could be read" in err
    assert f"unreadable ledger index {first}" in err
    assert len(lost) == 6
    assert second.exists()


_KILLED_WRITER = """
import sys, time
from lightning_pilot.storage import publish_file

def write(handle):
    handle.write(b"PAR1 half a file")
    handle.flush()
    print("ready", flush=True)
    time.sleep(600)  # killed here: after the temporary file exists, before it is published

publish_file(sys.argv[1], write)
"""


def test_compaction_removes_the_temporary_files_of_killed_writers_once_old(
    tmp_path: Path,
) -> None:
    ids = _write_runs(tmp_path, 1)
    record = f"20990101T000000000000Z-{new_run_id()}-end-{new_run_id()}.parquet"
    segment = "segment-20990101T000000000000Z-killed.parquet"
    for target in (tmp_path / record, tmp_path / "_index" / segment):
        writer = _start(_KILLED_WRITER, target)
        writer.send_signal(signal.SIGKILL)
        writer.communicate(timeout=60)
    left = sorted(tmp_path.glob(".*.tmp")) + sorted((tmp_path / "_index").glob(".*.tmp"))
    assert [p.name.split(".")[1] for p in left] == [record.split(".")[0], segment.split(".")[0]]
    assert not (tmp_path / record).exists()  # never published: readers never see it
    # Young, they may belong to a live writer: kept, even with grace=0.
    compact_ledger(tmp_path, grace=0)
    assert all(p.exists() for p in left)
    # Older than the grace period (an hour by default): removed by the next compaction; a
    # hidden file that is not a temporary file of ours, however old, stays.
    other = tmp_path / ".keep"
    other.write_bytes(b"")
    old = time.time() - 2 * storage.ledger_store.LEDGER_GRACE_SECONDS
    for path in (*left, other):
        os.utime(path, (old, old))
    young = tmp_path / f".{record}.{'0' * 32}.tmp"
    young.write_bytes(b"in progress")
    compact_ledger(tmp_path)
    assert not any(p.exists() for p in left)
    assert young.exists()
    assert other.exists()
    assert sorted(read_ledger_records(tmp_path)["record_id"]) == sorted(ids)


def test_compaction_argument_is_checked() -> None:
    with pytest.raises(ValueError, match=r"compact_ledger\(grace=-1\) is invalid"):
        compact_ledger("/nonexistent", grace=-1)


def test_writing_a_record_never_lists_the_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_runs(tmp_path, 1)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a writer listed the ledger folder")

    monkeypatch.setattr(os, "scandir", refuse)
    monkeypatch.setattr(Path, "iterdir", refuse)
    monkeypatch.setattr(Path, "glob", refuse)
    run_id = new_run_id()
    write_ledger_record(tmp_path, {"run_id": run_id, "event": "start", "status": "running"})
    monkeypatch.undo()
    assert run_id in set(read_ledger_records(tmp_path)["run_id"])


def test_segments_written_before_compaction_still_read(tmp_path: Path) -> None:
    # Index segments of earlier versions carried a source_file column naming the record files.
    ids = _write_runs(tmp_path, 2)
    table = pa.concat_tables(
        [pq.read_table(f).cast(LEDGER_SCHEMA) for f in _record_files(tmp_path)]
    )
    names = [f.name for f in _record_files(tmp_path)]
    old = table.append_column("source_file", pa.array(names))
    (tmp_path / "_index").mkdir()
    pq.write_table(old, tmp_path / "_index" / "segment-20250101T000000000000Z-0123456789ab.parquet")
    assert sorted(read_ledger_records(tmp_path)["record_id"]) == sorted(ids)
    compact_ledger(tmp_path, grace=0)
    assert _record_files(tmp_path) == []
    assert sorted(read_ledger_records(tmp_path)["record_id"]) == sorted(ids)


def test_compaction_on_an_fsspec_location() -> None:
    folder = storage.location(f"memory://team-{new_run_id()}/pilot/ledger")
    ids = _write_runs(folder, 3)
    before = _quiet_runs(folder)
    written = compact_ledger(folder, grace=0)
    assert [p.parent.name for p in written] == ["_index"]
    names = [p.name for p in folder.iterdir()]
    assert names == ["_index"]  # every record file removed; its records are in the segment
    records = read_ledger_records(folder)
    assert sorted(records["record_id"]) == sorted(ids)
    after = _quiet_runs(folder)
    pd.testing.assert_frame_equal(after, before)


# ------------------------------------------------------------------------------------------
# 4. where analysts are: the DuckDB and Polars queries of docs/ledger.md
# ------------------------------------------------------------------------------------------

KEY_COLUMNS = [
    "run_id",
    "experiment",
    "variant",
    "seed",
    "status",
    "stop_cause",
    "stop_step",
    "updates_done",
    "planned_updates",
    "started_at",
    "last_event",
    "records",
    "attempts",
]


def _doc_block(language: str, contains: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), flags=re.S)
    (block,) = [b for b in blocks if contains in b]
    return str(block)


@pytest.fixture
def team_ledger(tmp_path: Path) -> Path:
    """A ledger in every state at once: compacted runs, records not yet compacted, a record in
    two segments and in its file, a run resumed as attempt 2, a killed run, a running one."""
    folder = tmp_path / "pilot" / "ledger"
    _write_runs(folder, 6)
    index_ledger(folder)
    segment = _segments(folder)[0]
    (folder / "_index" / "segment-copy.parquet").write_bytes(segment.read_bytes())
    _write_runs(folder, 4)
    run = {"run_id": new_run_id(), "experiment": "e", "variant": "v0", "seed": 99}
    for attempt, event, status in (
        (1, "start", "running"),
        (1, "end", "failed"),
        (2, "start", "running"),
        (2, "end", "completed"),
    ):
        write_ledger_record(
            folder,
            {
                **run,
                "attempt": attempt,
                "event": event,
                "status": status,
                "planned_updates": 40 if event == "start" else None,
            },
        )
    hours_ago = datetime.now(timezone.utc) - timedelta(hours=3)
    killed = {"run_id": new_run_id(), "experiment": "e", "variant": "v1", "seed": 7}
    write_ledger_record(
        folder, {**killed, "event": "start", "status": "running", "written_at": hours_ago}
    )
    write_ledger_record(folder, {"run_id": new_run_id(), "event": "start", "status": "running"})
    return folder


def _same_runs(frame: pd.DataFrame, folder: Path) -> None:
    expected = _quiet_runs(folder)[KEY_COLUMNS]
    assert set(expected["status"]) >= {"completed", "interrupted", "running", "diverged"}
    got = frame[KEY_COLUMNS]
    expected = expected.sort_values("run_id").reset_index(drop=True)
    got = got.sort_values("run_id").reset_index(drop=True)
    for column in KEY_COLUMNS:  # the values, whatever each library's dtypes
        want = expected[column].astype(object).where(expected[column].notna(), None).tolist()
        have = got[column].astype(object).where(got[column].notna(), None).tolist()
        if column == "started_at":
            want = [pd.Timestamp(v) for v in want]
            have = [pd.Timestamp(v).tz_convert("UTC") for v in have]
        assert have == want, column


def test_the_duckdb_query_gives_the_runs_table(team_ledger: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    query = _doc_block("sql", "read_parquet").replace("<ledger>", str(team_ledger))
    frame = duckdb.connect().sql(query).df()
    _same_runs(frame, team_ledger)


def test_the_polars_query_gives_the_runs_table(team_ledger: Path) -> None:
    pytest.importorskip("polars")
    code = _doc_block("python", "import polars").replace("<ledger>", str(team_ledger))
    namespace: dict[str, Any] = {}
    exec(compile(textwrap.dedent(code), str(DOCS), "exec"), namespace)
    _same_runs(namespace["runs"].to_pandas(), team_ledger)


def test_queries_agree_after_compaction_too(team_ledger: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    compact_ledger(team_ledger, grace=0)
    assert _record_files(team_ledger) == []
    query = _doc_block("sql", "read_parquet").replace("<ledger>", str(team_ledger))
    _same_runs(duckdb.connect().sql(query).df(), team_ledger)
