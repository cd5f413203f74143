"""Write and fold a run ledger of many runs: how long reading, folding and indexing take.

Writes ``--runs`` runs through the real writer (a ``start``, a ``heartbeat`` with the first 10
points of the curve, as a delta, and an ``end`` record with all 20; one run in ten has no end
record, as if killed, so its curve is joined from the heartbeat: one immutable Parquet file per
record), then times:

* reading every record file and folding them into one row per run (``Ledger.runs()``);
* building the index (``Ledger.index()``: one segment holding copies of all records);
* reading and folding again, from the index;
* every run's curves in long format (``Ledger.curves()``, which joins heartbeat deltas).

    python benchmarks/ledger_scale.py --runs 10000 --out /tmp/ledger-scale
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from lightning_pilot import Ledger
from lightning_pilot.core.ids import new_run_id
from lightning_pilot.ledger import fold_records
from lightning_pilot.storage import write_ledger_record

STATUSES = ("completed", "completed", "completed", "diverged", "failed")


def write(folder: Path, runs: int) -> float:
    started = time.perf_counter()
    for index in range(runs):
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
        write_ledger_record(folder, base | {"event": "start", "status": "running"})
        write_ledger_record(
            folder,
            base
            | {"event": "heartbeat", "status": "running", "curves_delta": True}
            | {"train_loss": curve[:10]},
        )
        if index % 10 == 9:
            continue  # killed: no end record
        status = STATUSES[index % len(STATUSES)]
        write_ledger_record(
            folder,
            base
            | {
                "event": "end",
                "status": status,
                "stop_cause": "max_steps" if status == "completed" else "nonfinite_loss",
                "updates_done": 200,
                "train_loss": curve,
            },
        )
    return time.perf_counter() - started


def timed(label: str, fn: object) -> object:
    started = time.perf_counter()
    result = fn()  # type: ignore[operator]
    print(f"{label}: {time.perf_counter() - started:.2f} s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--out", default="/tmp/lightning-pilot-ledger-scale")
    parser.add_argument("--keep", action="store_true", help="reuse an existing ledger in --out")
    args = parser.parse_args()
    folder = Path(args.out)
    if not args.keep or not folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        seconds = write(folder, args.runs)
        print(f"wrote the records of {args.runs} runs in {seconds:.1f} s")
    ledger = Ledger(folder)
    records = timed("read every record file", ledger.records)
    timed("fold into one row per run", lambda: fold_records(records))  # type: ignore[arg-type]
    timed("build the index", ledger.index)
    runs = timed("read from the index and fold (Ledger.runs)", ledger.runs)
    print(f"{len(runs)} runs; statuses: {runs['status'].value_counts().to_dict()}")  # type: ignore[index]
    curves = timed("every run's curves (Ledger.curves)", ledger.curves)
    print(f"{len(curves)} curve points")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
