"""A ledger of many runs, in today's layout and compacted: write, compaction and cold reads.

Writes ``--runs`` runs through the real writer (a ``start``, a ``heartbeat`` with the first 10
points of the curve, as a delta, and an ``end`` record with all 20; one run in ten has no end
record, as if killed, so its curve is joined from the heartbeat: one immutable Parquet file per
record), then measures, each read cold (a new Python process, imports included, as a notebook
or ``lightning-pilot show`` would):

* writing: the time per record over the first and the last tenth of the records (a record's
  cost must not grow with the ledger);
* one file per record (the layout before compaction): ``Ledger(path).runs()`` and
  ``Ledger(path).curves()``, the number of files;
* compaction (``Ledger.compact(grace=0)``: every record into segments, every record file
  removed), then ``runs()`` and ``curves()`` again, the number of files.

    python benchmarks/ledger_scale.py --runs 10000 --out /tmp/ledger-scale
    python benchmarks/ledger_scale.py --runs 100000 --writers 2 --skip-uncompacted-reads
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lightning_pilot import Ledger
from lightning_pilot.core.ids import new_run_id
from lightning_pilot.storage import write_ledger_record

STATUSES = ("completed", "completed", "completed", "diverged", "failed")

COLD = """
import sys, time
started = time.perf_counter()
from lightning_pilot.ledger import Ledger
imported = time.perf_counter()
frame = getattr(Ledger(sys.argv[1]), sys.argv[2])()
done = time.perf_counter()
print(f"{done - started:.3f} {done - imported:.3f} {len(frame)}")
"""


def write(folder: Path, runs: int, first: int = 0) -> list[float]:
    """Write runs ``first`` .. ``first + runs - 1``; the seconds each record took."""
    times = []
    for index in range(first, first + runs):
        run_id = new_run_id()
        base = {
            "run_id": run_id,
            "attempt": 1,
            "experiment": "scale",
            "variant": f"lr-{index % 3}",
            "seed": index,
            "lr": 1e-4 * (1 + index % 3),
        }
        curve = [{"step": step * 10, "value": 2.0 / (step + 1)} for step in range(20)]
        records = [
            base | {"event": "start", "status": "running"},
            base
            | {"event": "heartbeat", "status": "running", "curves_delta": True}
            | {"train_loss": curve[:10]},
        ]
        if index % 10 != 9:  # one run in ten is killed: no end record
            status = STATUSES[index % len(STATUSES)]
            records.append(
                base
                | {
                    "event": "end",
                    "status": status,
                    "stop_cause": "max_steps" if status == "completed" else "nonfinite_loss",
                    "updates_done": 200,
                    "train_loss": curve,
                }
            )
        for record in records:
            started = time.perf_counter()
            write_ledger_record(folder, record)
            times.append(time.perf_counter() - started)
    return times


def _write_part(args: tuple[Path, int, int]) -> list[float]:
    return write(*args)


def cold(folder: Path, method: str) -> tuple[float, float, int]:
    """(process seconds, seconds in the call, rows) of ``Ledger(folder).<method>()`` in a new
    Python process."""
    out = subprocess.run(
        [sys.executable, "-c", COLD, str(folder), method],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return float(out[0]), float(out[1]), int(out[2])


def files(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*.parquet") if not p.name.startswith("."))


def report_reads(label: str, folder: Path) -> None:
    for method in ("runs", "curves"):
        total, call, rows = cold(folder, method)
        print(
            f"{label}: cold Ledger.{method}(): {total:.2f} s"
            f" ({call:.2f} s in the call), {rows} rows"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--out", default="/tmp/lightning-pilot-ledger-scale")
    parser.add_argument("--writers", type=int, default=1, help="writer processes at once")
    parser.add_argument("--keep", action="store_true", help="reuse an existing ledger in --out")
    parser.add_argument(
        "--skip-uncompacted-reads",
        action="store_true",
        help="do not time the reads of the ledger before compaction (minutes at 100,000 runs)",
    )
    args = parser.parse_args()
    folder = Path(args.out)
    begun = time.perf_counter()
    if not args.keep or not folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        started = time.perf_counter()
        share = -(-args.runs // args.writers)
        parts = [
            (folder, min(share, args.runs - w * share), w * share) for w in range(args.writers)
        ]
        with multiprocessing.get_context("spawn").Pool(args.writers) as pool:
            times = [t for part in pool.map(_write_part, parts) for t in part]
        seconds = time.perf_counter() - started
        tenth = max(1, len(times) // 10)
        print(
            f"wrote {len(times)} records of {args.runs} runs in {seconds:.1f} s with"
            f" {args.writers} writer(s); per record: first tenth"
            f" {1000 * sum(times[:tenth]) / tenth:.2f} ms, last tenth"
            f" {1000 * sum(times[-tenth:]) / tenth:.2f} ms"
        )
    print(f"one file per record: {files(folder)} files")
    if not args.skip_uncompacted_reads:
        report_reads("one file per record", folder)
    started = time.perf_counter()
    segments = Ledger(folder).compact(grace=0)
    print(
        f"compaction (Ledger.compact(grace=0)): {time.perf_counter() - started:.1f} s,"
        f" {len(segments)} segments; now {files(folder)} files"
    )
    report_reads("compacted", folder)
    started = time.perf_counter()
    Ledger(folder).compact(grace=0)
    print(f"compaction again, nothing new: {time.perf_counter() - started:.2f} s")
    print(f"benchmark took {time.perf_counter() - begun:.0f} s")


if __name__ == "__main__":
    main()
