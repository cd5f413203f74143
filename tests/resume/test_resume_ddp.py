"""ResumeVerifier and every pilot callback under two-process DDP (gloo on CPU).

Apart from tests/resume/test_resume_verifier.py so that pytest-xdist (``--dist loadfile``)
runs these process-heavy tests beside the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from lightning_pilot import Ledger, read_phase_table

pytestmark = pytest.mark.timeout(300)


def _checks(frame: pd.DataFrame) -> dict[str, tuple[str, str]]:
    row = frame[frame["phase"] == "resume"].iloc[0]
    return {c["name"]: (c["verdict"], c["detail"]) for c in row["checks"]}


def _ddp_pilot(out: Path, *args: str, torchrun: bool = False) -> list[dict[str, Any]]:
    """Run tests/workers/ddp_pilot.py (2 gloo processes, every pilot callback); rank reports.

    Started by Lightning's own launcher, or with ``torchrun=True`` by torch's elastic launcher.
    """
    import json
    import os
    import subprocess
    import sys

    worker = Path(__file__).parents[1] / "workers" / "ddp_pilot.py"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [sys.executable, *(launcher if torchrun else []), str(worker), str(out), *args],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.distributed
def test_every_pilot_callback_under_two_process_ddp(tmp_path: Path) -> None:
    # 32 examples, 4 per rank per update: 4 updates per epoch, so both probes are taken.
    ranks = _ddp_pilot(tmp_path, "--dataset-size", "32", "--steps", "8")
    assert ranks[0]["run_id"] == ranks[1]["run_id"]  # one run, agreed at setup
    table = read_phase_table(tmp_path / "pilot")
    assert set(table["rank"]) == {0, 1}
    assert set(table["world_size"]) == {2}
    assert {"forward", "optimizer_step", "validation"} <= set(table[table["rank"] == 1]["phase"])
    # The resume is checked as the fit ran: one new process per rank, together a DDP group,
    # each rank replaying its own shard and comparing with its own reference.
    per_rank = {r: _checks(table[table["rank"] == r]) for r in (0, 1)}
    for rank, checks in per_rank.items():
        assert checks["weights_only_load"] == (
            "pass",
            "loaded in 2 new processes (one per rank, DDP)",
        )
        for name in ("global_step", "lrs", "optimizer_state", "weights", "rng", "lr_trajectory"):
            assert checks[name][0] == "pass", (rank, name, checks[name])
        for name in ("data_position", "loss_trajectory", "epoch_boundary.data_position"):
            assert checks[name][0] in ("pass", "fail"), (rank, name, checks[name])  # checked
    # Each rank compared its own micro-batches: the ids of the first compared batch differ.
    first = {r: per_rank[r]["data_position"][1] for r in (0, 1)}
    if per_rank[0]["data_position"][0] == "fail":
        assert first[0] != first[1]
    (run,) = Ledger(tmp_path / "pilot").runs().to_dict("records")
    assert (run["status"], run["dp_replicas"], run["effective_batch_size"]) == ("completed", 2, 8)


@pytest.mark.distributed
def test_a_blowup_on_one_rank_stops_both_ranks_with_every_callback(tmp_path: Path) -> None:
    ranks = _ddp_pilot(tmp_path, "--blowup-at", "3", "--steps", "12")
    # Rank 1's loss blows up from update 3 (patience 2): both ranks stop after update 4.
    assert [r["global_step"] for r in ranks] == [4, 4]
    (run,) = Ledger(tmp_path / "pilot").runs().to_dict("records")
    assert (run["status"], run["stop_cause"], run["stop_step"]) == ("diverged", "loss_blowup", 4)
    assert run["stop_detail"] == "loss_blowup fired on another rank at step 4"
    assert (run["dp_replicas"], run["updates_done"]) == (2, 4)
    table = read_phase_table(tmp_path / "pilot")
    assert set(table["rank"]) == {0, 1}


@pytest.mark.distributed
def test_a_blowup_after_the_last_evaluation_on_one_rank_still_reaches_the_ledger(
    tmp_path: Path,
) -> None:
    # Rules evaluated every 10 updates; rank 1 blows up at updates 11 and 12, after the last
    # evaluation (update 10): the ranks agree at the end of the fit instead.
    ranks = _ddp_pilot(tmp_path, "--blowup-at", "11", "--steps", "12", "--check-every", "10")
    assert [r["global_step"] for r in ranks] == [12, 12]
    (run,) = Ledger(tmp_path / "pilot").runs().to_dict("records")
    assert (run["status"], run["stop_cause"], run["stop_step"]) == ("diverged", "loss_blowup", 12)
    assert run["stop_detail"] == "loss_blowup fired on another rank at step 12"


@pytest.mark.distributed
def test_the_per_rank_resume_check_runs_under_torchrun(tmp_path: Path) -> None:
    # torchrun's environment (an agent store, TORCHELASTIC_* variables) must not leak into the
    # verification group: it would wait for a store nobody serves.
    ranks = _ddp_pilot(tmp_path, "--steps", "5", torchrun=True)
    assert ranks[0]["run_id"] == ranks[1]["run_id"]
    table = read_phase_table(tmp_path / "pilot")
    for rank in (0, 1):
        checks = _checks(table[table["rank"] == rank])
        assert checks["weights_only_load"] == (
            "pass",
            "loaded in 2 new processes (one per rank, DDP)",
        )
        assert checks["global_step"][0] == "pass"
