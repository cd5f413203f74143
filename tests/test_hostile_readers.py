"""Hostile and misplaced files in the folders the readers read.

Each case is a real file, crafted with pyarrow as an adversary (or an accident) would leave it:
the readers must check what a file's footer declares before decoding anything, skip the file
with a warning naming it and the limit it broke, say what they skipped, and read the rest.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_pilot import storage
from lightning_pilot.core.ids import new_run_id
from lightning_pilot.ledger import Ledger
from lightning_pilot.storage import (
    PHASE_SCHEMA,
    SkippedFileWarning,
    read_ledger_records,
    read_phase_table,
    rows_to_table,
    write_ledger_record,
    write_snapshot,
)

#: Rows of the crafted file: 1 million one-character strings in a few KB of zstd Parquet
#: (865 MiB once read into pandas before the readers checked the footer). docs/ledger.md
#: measures the 30-million-row variant.
ROWS = 1_000_000


def _dictionary_column(n: int, value: str = "x") -> pa.DictionaryArray:
    # n references to one dictionary value: built without materialising n strings.
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([value]))


def _hostile(path: Path, n: int = ROWS, *, column: str = "phase", value: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: _dictionary_column(n, value)}), path, compression="zstd")
    return path


def _phase_run(out_dir: Path, run: str, verdict: str = "pass") -> None:
    row = {"run_id": new_run_id(), "attempt": 1, "rank": 0, "phase": "forward", "verdict": verdict}
    write_snapshot(
        out_dir / "runs" / run / "phases.parquet",
        rows_to_table([row], PHASE_SCHEMA),
        writer="w",
        seq=1,
    )


def _messages(caught: pytest.WarningsRecorder) -> str:
    return "\n".join(str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------
# 1. a small file declaring a huge table is skipped before it is decoded
# ------------------------------------------------------------------------------------------


def test_oversized_phase_parts_are_skipped_and_the_rest_reads(tmp_path: Path) -> None:
    _phase_run(tmp_path, "good", verdict="fail")
    # One hostile part in the good run's table, one in a run of its own.
    evil = _hostile(tmp_path / "runs" / "good" / "phases.parquet" / "part-evil.parquet")
    other = _hostile(tmp_path / "runs" / "other" / "phases.parquet" / "part-other.parquet")
    assert evil.stat().st_size < 64 * 1024  # a few KB on disk
    with pytest.warns(SkippedFileWarning) as caught:
        frame = read_phase_table(tmp_path)
    text = _messages(caught)
    for path in (evil, other):
        assert f"skipped oversized file {path}" in text
    assert "1,000,000 rows > PHASE_FILE_LIMITS.max_rows=100,000" in text
    assert frame["verdict"].tolist() == ["fail"]  # the real row survives, with its verdict
    assert sorted(frame.attrs["skipped"]) == sorted([str(evil), str(other)])


def test_oversized_ledger_record_and_index_segment_are_skipped(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    run_id = new_run_id()
    write_ledger_record(ledger, {"run_id": run_id, "event": "start", "status": "running"})
    evil = _hostile(ledger / f"20990101T000000000000Z-{run_id}-end-x.parquet", column="status")
    segment = _hostile(ledger / "_index" / "segment-evil.parquet", column="status")
    with pytest.warns(SkippedFileWarning) as caught:
        runs = Ledger(tmp_path).runs()
    text = _messages(caught)
    assert f"{evil}: 1,000,000 rows > LEDGER_RECORD_LIMITS.max_rows=1,000" in text
    assert f"{segment}: 1,000,000 rows > LEDGER_SEGMENT_LIMITS.max_rows=50,000" in text
    assert runs["run_id"].tolist() == [run_id]
    assert runs["records"].tolist() == [1]
    # index_ledger leaves the hostile record out of the index (the readers report it).
    with pytest.warns(SkippedFileWarning):
        storage.index_ledger(ledger)
    with pytest.warns(SkippedFileWarning, match="oversized"):
        assert len(read_ledger_records(ledger)) == 1


def test_a_long_value_repeated_by_a_dictionary_is_measured_before_it_is_decoded(
    tmp_path: Path,
) -> None:
    # 2,000 rows (well under the row limit) referencing one 1 MB string: 2 GB once decoded,
    # 1 KB on disk. Only the dictionary (1 MB) and the indices are read to find out.
    _phase_run(tmp_path, "good")
    evil = _hostile(
        tmp_path / "runs" / "good" / "phases.parquet" / "part-long.parquet",
        2_000,
        column="notes",
        value="y" * 1_000_000,
    )
    before = pa.default_memory_pool().max_memory()
    with pytest.warns(SkippedFileWarning, match=r"part-long\.parquet: .*max_decoded_bytes"):
        frame = read_phase_table(tmp_path)
    assert len(frame) == 1
    assert frame.attrs["skipped"] == [str(evil)]
    # Arrow's peak allocation stayed far below the 2 GB a decode would take.
    assert pa.default_memory_pool().max_memory() < max(before, 0) + 256 * 1024 * 1024


def test_oversized_detail_part_is_skipped(tmp_path: Path) -> None:
    folder = tmp_path / "examples.parquet"
    write_snapshot(folder, pa.table({"split": ["train"]}), writer="w", seq=1)
    evil = _hostile(folder / "part-evil.parquet", 12_000_000, column="split")
    with pytest.warns(SkippedFileWarning, match=r"DETAIL_FILE_LIMITS\.max_rows"):
        table = storage.read_snapshot_table(folder)
    assert table.column("split").to_pylist() == ["train"]
    assert evil.exists()  # readers never delete what they skip


def test_files_within_the_limits_read_as_before(tmp_path: Path) -> None:
    # The writers' own output, at the sizes they produce, is far inside the limits: a ledger
    # end record with a 200-update curve and a phase snapshot of 5,000 rows.
    points = [{"step": s, "value": 1.0 / s} for s in range(1, 201)]
    write_ledger_record(
        tmp_path / "ledger",
        {"run_id": new_run_id(), "event": "end", "status": "completed", "train_loss": points,
         "lr_curve": points, "val_points": [{"step": 200, "name": "val_loss", "value": 0.5}]},
    )  # fmt: skip
    rows = [
        {"run_id": "r", "attempt": 1, "rank": 0, "phase": "forward", "notes": f"note {i}" * 20,
         "checks": [{"name": f"c{i}", "verdict": "pass", "detail": "d" * 100}] * 5}
        for i in range(5_000)
    ]  # fmt: skip
    write_snapshot(
        tmp_path / "runs" / "r" / "phases.parquet",
        rows_to_table(rows, PHASE_SCHEMA),
        writer="w",
        seq=1,
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = read_ledger_records(tmp_path)
        frame = read_phase_table(tmp_path)
    assert len(records["train_loss"].iloc[0]) == 200
    assert len(frame) == 5_000
    assert frame.attrs["skipped"] == []


def test_the_writer_refuses_a_record_the_readers_would_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A smaller limit keeps the test cheap; the rule is the same at 2 million values.
    small = dataclasses.replace(storage.LEDGER_RECORD_LIMITS, max_values=1_000)
    monkeypatch.setattr(storage.ledger_store, "LEDGER_RECORD_LIMITS", small)
    points = [{"step": s, "value": 0.0} for s in range(1_000)]
    record = {"run_id": new_run_id(), "event": "end", "train_loss": points}
    with pytest.raises(ValueError, match=r"1,001 values in one column > LEDGER_RECORD_LIMITS"):
        write_ledger_record(tmp_path, record)
    assert list(tmp_path.iterdir()) == []
    write_ledger_record(tmp_path, record | {"train_loss": points[:999]})
    assert len(read_ledger_records(tmp_path)) == 1


# ------------------------------------------------------------------------------------------
# 3. phases.parquet replaced by a plain file
# ------------------------------------------------------------------------------------------


def test_a_plain_file_in_place_of_the_phase_table_folder_is_reported(tmp_path: Path) -> None:
    _phase_run(tmp_path, "good")
    plain = tmp_path / "runs" / "replaced" / "phases.parquet"
    plain.parent.mkdir(parents=True)
    pq.write_table(rows_to_table([{"phase": "resume", "verdict": "pass"}], PHASE_SCHEMA), plain)

    with pytest.warns(SkippedFileWarning) as caught:
        frame = read_phase_table(tmp_path)
    text = _messages(caught)
    assert f"skipped {plain}: expected a folder of snapshot parts" in text
    assert len(frame) == 1  # the good run still reads
    assert frame.attrs["skipped"] == [str(plain)]

    # The run folder alone: an empty table that says it is not clean, never a silent empty one.
    with pytest.warns(SkippedFileWarning, match="expected a folder of snapshot parts"):
        alone = read_phase_table(plain.parent)
    assert alone.empty
    assert alone.attrs["skipped"] == [str(plain)]
    with pytest.warns(SkippedFileWarning, match="expected a folder of snapshot parts"):
        assert read_phase_table(plain).attrs["skipped"] == [str(plain)]


# ------------------------------------------------------------------------------------------
# 4. records are read once, however many index segments or copies hold them (eight processes
#    writing and indexing at once: test_storage.py, on its shared eight-writer run)
# ------------------------------------------------------------------------------------------


def test_duplicate_segments_and_copies_are_read_once(tmp_path: Path) -> None:
    ids = [new_run_id() for _ in range(3)]
    files = [
        write_ledger_record(tmp_path, {"run_id": r, "event": "start", "status": "running"})
        for r in ids
    ]
    segment = storage.index_ledger(tmp_path)
    assert segment is not None
    # What two processes indexing at the same instant leave: two segments of the same records,
    # and a record copied under another name.
    (segment.parent / "segment-copy.parquet").write_bytes(segment.read_bytes())
    copy = tmp_path / files[0].name.replace("-start-", "-start-copy")
    copy.write_bytes(files[0].read_bytes())
    records = read_ledger_records(tmp_path)
    assert sorted(records["run_id"]) == sorted(ids)
    assert records["record_id"].is_unique
    assert Ledger(tmp_path).runs()["records"].tolist() == [1, 1, 1]
