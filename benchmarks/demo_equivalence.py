"""Compare two demo output folders: the same phase tables, detail tables and ledger?

A refactoring that keeps every behaviour must leave the demo's measurements unchanged. This
script reads two folders written by ``lightning-pilot demo --out DIR`` (for example one made
before a change and one after) and compares, run by run in creation order:

* every phase table row and every detail table row, on all columns but those that differ
  between two runs of the same code (ids, timestamps, durations, host memory, paths);
* the ledger: the start and end records and the whole curves (heartbeats are timed, so their
  number depends on the machine's speed; the curves they carry are joined and compared).

Usage::

    lightning-pilot demo --out /tmp/before        # on the old code
    lightning-pilot demo --out /tmp/after         # on the new code
    python benchmarks/demo_equivalence.py /tmp/before /tmp/after

It prints each difference and exits 1 when there is one, 0 when the folders agree.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from lightning_pilot.report.load import read_estimate
from lightning_pilot.storage import read_ledger_records, read_phase_table, read_snapshot_table

#: Columns that differ between two runs of the same code on the same machine.
VOLATILE = {
    "written_at",
    "run_id",
    "attempt_id",
    "record_id",
    "derived_from_run_id",
    "duration_s",
    "duration_median_s",
    "duration_max_s",
    "host_rss_bytes",
    "host_swap_used_bytes",
    "hostname",
    "git_revision",
    "predictions_uri",
    "checkpoint_uri",
    "phase_table_uri",
    "checkpoint_sha256",
    "predictions_sha256",
    "source_file",
    "schema_version",
    "file_bytes",
}
#: Phase-row and check texts may quote a duration or a host figure; these checks do.
VOLATILE_CHECKS = {"data_wait", "step_time", "host_memory"}
CURVES = ("train_loss", "lr_curve", "val_points")


def _plain(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if value is pd.NA or value is None:
        return None
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


_SHA256 = re.compile(r"\b[0-9a-f]{64}\b")
_RUN_FOLDER = re.compile(r"\S*/runs/[0-9TZ]+-[0-9a-f]{16}")


def _text(value: Any) -> Any:
    """Texts quote a run's folder and file digests: the same in content, not in characters."""
    if isinstance(value, str):
        return _RUN_FOLDER.sub("<run>", _SHA256.sub("<sha256>", value))
    if isinstance(value, list):
        return [_text(item) for item in value]
    if isinstance(value, dict):
        return {key: _text(item) for key, item in value.items()}
    return value


def _rows(frame: pd.DataFrame, sort: list[str]) -> list[dict[str, Any]]:
    keep = [column for column in frame.columns if column not in VOLATILE]
    frame = frame[keep]
    order = [column for column in sort if column in frame.columns]
    if order:
        frame = frame.sort_values(order, kind="stable")
    rows = [
        {key: _text(_plain(value)) for key, value in row.items()}
        for row in frame.to_dict("records")
    ]
    for row in rows:
        if isinstance(row.get("checks"), list):
            row["checks"] = [
                check for check in row["checks"] if check.get("name") not in VOLATILE_CHECKS
            ]
    return rows


def _runs(folder: Path) -> list[Path]:
    return sorted(path for path in (folder / "runs").iterdir() if path.is_dir())


def _tables(run: Path) -> dict[str, list[dict[str, Any]]]:
    tables: dict[str, list[dict[str, Any]]] = {}
    for table in sorted(run.glob("*.parquet")):
        name = table.name.removesuffix(".parquet")
        if name == "phases":
            frame = read_phase_table(run)
            tables[name] = _rows(frame, ["rank", "phase", "first"])
        elif name == "estimate":
            # Any version, in the current schema's columns: a renamed column is no difference.
            estimate = read_estimate(table)
            tables[name] = [] if estimate is None else _rows(estimate, [])
        else:
            frame = read_snapshot_table(table).to_pandas()
            tables[name] = _rows(frame, [c for c in frame.columns if c not in VOLATILE][:6])
    return tables


def _ledger(folder: Path) -> list[dict[str, Any]]:
    records = read_ledger_records(folder / "ledger").sort_values("written_at", kind="stable")
    out = []
    for _, group in records.groupby("run_id", sort=False):
        # The end record carries the whole curves (heartbeats only the points since the last).
        final = group[group["event"] == "end"].tail(1)
        curves = {name: [_plain(points) for points in final[name]] for name in CURVES}
        ends = group[group["event"].isin(["start", "end"])].drop(columns=list(CURVES))
        out.append({"records": _rows(ends, []), "curves": curves})
    return out


def differences(before: Path, after: Path) -> list[str]:
    """Every difference between two demo folders, in words (empty when they agree)."""
    found: list[str] = []
    runs_before, runs_after = _runs(before), _runs(after)
    if len(runs_before) != len(runs_after):
        found.append(f"run folders: {len(runs_before)} before, {len(runs_after)} after")
    for index, (one, two) in enumerate(zip(runs_before, runs_after, strict=False)):
        tables_one, tables_two = _tables(one), _tables(two)
        if sorted(tables_one) != sorted(tables_two):
            found.append(f"run {index}: tables {sorted(tables_one)} != {sorted(tables_two)}")
        for name in sorted(set(tables_one) & set(tables_two)):
            rows_one, rows_two = tables_one[name], tables_two[name]
            if len(rows_one) != len(rows_two):
                found.append(f"run {index} {name}: {len(rows_one)} rows != {len(rows_two)}")
            for row_one, row_two in zip(rows_one, rows_two, strict=False):
                for key in sorted(set(row_one) | set(row_two)):
                    if row_one.get(key) != row_two.get(key):
                        found.append(
                            f"run {index} {name} [{row_one.get('phase', '')}] {key}:"
                            f" {row_one.get(key)!r} != {row_two.get(key)!r}"
                        )
    ledger_one, ledger_two = _ledger(before), _ledger(after)
    if len(ledger_one) != len(ledger_two):
        found.append(f"ledger runs: {len(ledger_one)} before, {len(ledger_two)} after")
    for index, (one, two) in enumerate(zip(ledger_one, ledger_two, strict=False)):
        if one["curves"] != two["curves"]:
            found.append(f"ledger run {index}: the curves differ")
        for rec_one, rec_two in zip(one["records"], two["records"], strict=False):
            for key in sorted(set(rec_one) | set(rec_two)):
                if rec_one.get(key) != rec_two.get(key):
                    found.append(
                        f"ledger run {index} {rec_one.get('event')} {key}:"
                        f" {rec_one.get(key)!r} != {rec_two.get(key)!r}"
                    )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    found = differences(args.before, args.after)
    for line in found:
        print(line)
    print(f"{len(found)} difference(s) between {args.before} and {args.after}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
