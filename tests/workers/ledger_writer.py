"""Worker process for the concurrency tests: publishes ledger records into one folder.

Usage: python ledger_writer.py LEDGER_DIR WORKER RECORDS GO_FILE SAME_NS [INDEX_EVERY]

Prints "ready", waits until GO_FILE exists (so every worker publishes at the same time), then
writes RECORDS records whose run ids are all made at the same instant SAME_NS (the same
millisecond in every process), and prints the run ids it used, one per line. With INDEX_EVERY
(> 0) it also indexes the ledger (``index_ledger``) after every INDEX_EVERY records and once at
the end, while the other workers write and index.
"""

from __future__ import annotations

import os
import sys
import time

from lightning_pilot.core.ids import new_run_id
from lightning_pilot.storage import index_ledger, write_ledger_record


def main() -> None:
    ledger_dir, worker, records, go_file, same_ns = sys.argv[1:6]
    index_every = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while not os.path.exists(go_file):
        time.sleep(0.001)
    for index in range(int(records)):
        run_id = new_run_id(now_ns=int(same_ns))
        write_ledger_record(
            ledger_dir,
            {
                "run_id": run_id,
                "event": "start",
                "status": "running",
                "experiment": "concurrency",
                "variant": f"worker-{worker}",
                "seed": index,
            },
        )
        sys.stdout.write(run_id + "\n")
        if index_every > 0 and (index + 1) % index_every == 0:
            index_ledger(ledger_dir)
    if index_every > 0:
        index_ledger(ledger_dir)


if __name__ == "__main__":
    main()
