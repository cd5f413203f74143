"""Several fault drills of ``fault_fit.py`` from one process: the imports once, one fork each.

Usage: python fault_fork.py SPEC_JSON

``SPEC_JSON`` names a list of drills, ``{"out": folder, "variant": name, "args": [...]}``, where
``args`` are ``fault_fit.py``'s options after ``OUT_DIR --variant NAME``. Importing torch,
Lightning and lightning_pilot is most of what one drill costs on a CPU (about 6 CPU-seconds,
against well under one for its 6-update fit), so this process imports them once and then forks
one process per drill, all at once. Each drill's process is what ``fault_fit.py`` started with
``start_new_session=True`` would be: a session and process group of its own (killing the group
takes its children), its output in ``OUT/VARIANT.log``, and ``fault_fit.main()`` run with the
drill's arguments; it first publishes its pid in ``OUT/VARIANT.pid``. ResumeVerifier's
verification process is still a new Python process that the drill starts.

This process waits for every drill; once a drill has ended it SIGKILLs the drill's process
group (a verification process orphaned by a kill) and publishes ``OUT/VARIANT.status``: the
exit status as :mod:`subprocess` reports it (``-9`` for SIGKILL). It exits once all have ended.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import suppress
from pathlib import Path
from typing import Any

import fault_fit  # torch, Lightning and lightning_pilot: imported once, before the forks


def publish(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (the test polls for it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def start(drill: dict[str, Any]) -> int:
    """Fork the drill's process; returns its pid here, never returns in the drill's process."""
    out, variant = Path(drill["out"]), str(drill["variant"])
    out.mkdir(parents=True, exist_ok=True)
    pid = os.fork()
    if pid:
        return pid
    os.setsid()
    log = os.open(out / f"{variant}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    publish(out / f"{variant}.pid", str(os.getpid()))
    sys.argv = [fault_fit.__file__, str(out), "--variant", variant, *drill["args"]]
    fault_fit.main()
    # The interpreter ends as fault_fit.py's would (exit handlers run, streams flushed).
    sys.exit(0)


def main() -> None:
    drills = json.loads(Path(sys.argv[1]).read_text())
    sys.stdout.flush()
    sys.stderr.flush()
    running = {start(drill): drill for drill in drills}
    while running:
        pid, status = os.wait()
        drill = running.pop(pid)
        with suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        code = os.waitstatus_to_exitcode(status)
        publish(Path(drill["out"]) / f"{drill['variant']}.status", str(code))


if __name__ == "__main__":
    main()
