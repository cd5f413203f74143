"""Pilot folders on fsspec locations: an S3-compatible server started here (moto's threaded
server, s3fs as the client) and ``memory://``. A full pilot with ``out_dir=s3://...`` (run once,
read by several tests) and with ``default_root_dir=s3://...``, the phase table and the ledger
read back, 8 writer processes, an existing key refused, ``lightning-pilot show s3://...``, and
``sheet`` and ``plot`` writing next to a remote run folder (docs/storage.md)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_pilot import Ledger, read_phase_table, storage
from lightning_pilot.cli import main
from lightning_pilot.core.ids import new_run_id
from lightning_pilot.demo import InstructionDataModule, TinyCausalLM
from lightning_pilot.pilot import pilot_callbacks

BUCKET = "pilot-bucket"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """An S3-compatible server on a free port; credentials and endpoint in the environment,
    the way a user gives them to s3fs (and to every process a test starts)."""
    s3fs = pytest.importorskip("s3fs")  # the `test` extra installs it, with moto[server]
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # none may keep an earlier endpoint
        storage.location(f"s3://{BUCKET}").fs.mkdir(BUCKET)
        try:
            yield env
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            server.stop()


def _fit(trainer_options: dict[str, Any], callbacks: list[Any]) -> Any:
    import lightning.pytorch as pl

    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "max_steps": 6,
        "limit_val_batches": 2,
        "callbacks": callbacks,
        **trainer_options,
    }
    trainer = pl.Trainer(**options)
    data = InstructionDataModule(dataset_size=128, batch_size=4, max_length=20, stateful=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyCausalLM(max_length=20, d_model=32, n_heads=2, n_layers=1), datamodule=data)
    return trainer


def _check_pilot(out: str, trainer: Any, run_ids: set[str], variant: str) -> None:
    table = read_phase_table(out)
    assert set(table["run_id"]) == run_ids
    assert {"forward", "backward", "optimizer_step", "data", "resume"} <= set(table["phase"])
    assert "fail" not in set(table["verdict"]), table[table["verdict"] == "fail"]["reason"]
    resume = table[table["phase"] == "resume"].iloc[0]
    assert resume["verdict"] == "pass", resume["reason"]
    assert table.attrs["skipped"] == []
    runs = Ledger(out).runs()
    assert runs["run_id"].tolist() == sorted(run_ids)
    assert runs[["variant", "status"]].values.tolist() == [[variant, "completed"]]
    assert runs["updates_done"].tolist() == [6] == [trainer.global_step]
    assert runs["records"].tolist()[0] >= 2  # start and end, at least


@pytest.fixture(scope="module")
def s3_pilot(
    s3_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Any, list[Any], Path]]:
    """One full pilot with ``out_dir=s3://...`` (the resume check included), run once for the
    tests that read it: the URL, the Trainer, the callbacks and the local working folder."""
    tmp_path = tmp_path_factory.mktemp("s3-pilot")
    out = f"s3://{BUCKET}/x-{uuid.uuid4().hex[:8]}"
    callbacks = pilot_callbacks(
        out, experiment="s3", variant="control", seed=1, resume={"at_step": 3, "compare_steps": 2}
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)  # where Path("s3://...") would have made a folder "s3:"
        trainer = _fit({"default_root_dir": tmp_path / "root"}, callbacks)
    yield out, trainer, callbacks, tmp_path
    storage.remove_work_folder(callbacks[0].run.run_dir)


def test_full_pilot_with_out_dir_on_s3(s3_pilot: tuple[str, Any, list[Any], Path]) -> None:
    out, trainer, callbacks, tmp_path = s3_pilot
    run_ids = {callback.run.run_id for callback in callbacks}
    assert len(run_ids) == 1
    assert all(isinstance(callback.run.out_dir, storage.RemotePath) for callback in callbacks)
    _check_pilot(out, trainer, run_ids, "control")
    (run_id,) = run_ids
    # The same layout as on a disk, every file published under its final name.
    fs = storage.location(out).fs
    names = fs.find(f"{BUCKET}/{out.split('/')[-1]}")
    assert any(f"/runs/{run_id}/phases.parquet/part-a0001-r00000-" in name for name in names)
    assert sum("/ledger/" in name for name in names) >= 2
    assert not any(name.rsplit("/", 1)[-1].startswith(".") for name in names)
    assert not (tmp_path / "s3:").exists()
    # The probe checkpoints of the resume check are local files (the new process loads them),
    # in a work folder named after the remote run folder; removed whole once done with.
    assert not any(name.endswith(".ckpt") for name in names)
    run_dir = callbacks[0].run.run_dir
    work = storage.work_folder(run_dir, "resume")
    assert sorted(p.name for p in work.glob("*.ckpt")) == [
        "final-attempt-1.ckpt",
        "mid_epoch-step-3.ckpt",
    ]
    assert storage.remove_work_folder(run_dir) == work.parent
    assert not work.parent.exists()
    assert storage.remove_work_folder(run_dir) is None  # nothing left to remove


def test_full_pilot_under_an_s3_default_root_dir(
    s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    root = f"s3://{BUCKET}/y-{uuid.uuid4().hex[:8]}"
    callbacks = pilot_callbacks(
        experiment="s3", variant="root", seed=2, resume={"at_step": 3, "compare_steps": 2}
    )
    trainer = _fit({"default_root_dir": root}, callbacks)
    run_ids = {callback.run.run_id for callback in callbacks}
    assert str(callbacks[0].run.out_dir) == f"{root}/pilot"
    _check_pilot(f"{root}/pilot", trainer, run_ids, "root")
    assert not (tmp_path / "s3:").exists()
    assert storage.remove_work_folder(callbacks[0].run.run_dir) is not None


def test_full_pilot_on_memory_then_its_sheet_and_plots_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = f"memory://pilot-{uuid.uuid4().hex[:8]}/out"
    callbacks = pilot_callbacks(
        out, experiment="mem", variant="control", seed=0, resume={"at_step": 3, "compare_steps": 2}
    )
    trainer = _fit({"default_root_dir": tmp_path}, callbacks)
    run = callbacks[0].run
    _check_pilot(out, trainer, {run.run_id}, "control")
    assert storage.remove_work_folder(run.run_dir) is not None
    _sheet_and_plots(out, run.run_id, capsys)


def _sheet_and_plots(
    out: str, run_id: str, capsys: pytest.CaptureFixture[str], *, again: bool = True
) -> None:
    """``lightning-pilot sheet`` and ``plot`` on a remote pilot folder: read there, and the
    Markdown and PNG files published there, with the rules of a local folder (a sheet is never
    overwritten: the next is sheet-2.md; plots are drawn again in place)."""
    run_url = f"{out}/runs/{run_id}"
    run_dir = storage.location(run_url)
    capsys.readouterr()
    assert main(["sheet", run_url]) == 0
    printed = capsys.readouterr().out
    assert f"Choice sheet written to {run_dir / 'sheet.md'}" in printed
    first = (run_dir / "sheet.md").read_bytes().decode()
    assert first.startswith(f"# Choice sheet: run {run_id}\n")
    assert f"from `{run_dir}`" in first
    assert "None drawn yet" in first  # no plots yet

    assert main(["plot", out, "--metric", "train_loss"]) == 0  # these fits never validate
    printed = capsys.readouterr().out
    assert f"Plots in {run_dir}:" in printed
    pngs = sorted(p.name for p in run_dir.glob("*.png"))
    assert pngs == ["comparison.png", "loss_curves.png", "phase_memory.png"]
    drawn = {name: (run_dir / name).read_bytes() for name in pngs}
    assert all(data.startswith(b"\x89PNG\r\n\x1a\n") for data in drawn.values())
    if again:  # drawn again: replaced in place, not refused; the run folder is a scope too
        assert main(["plot", run_url, "--metric", "train_loss"]) == 0
        assert sorted(p.name for p in run_dir.glob("*.png")) == pngs

    assert main(["sheet", run_url]) == 0
    assert (run_dir / "sheet.md").read_bytes().decode() == first  # never overwritten
    second = (run_dir / "sheet-2.md").read_bytes().decode()
    assert "![peak memory per phase, stacked by category](phase_memory.png)" in second
    assert "None drawn yet" not in second
    assert not any(p.name.startswith(".") for p in run_dir.iterdir())


_WRITER = textwrap.dedent(
    """
    import json, sys
    from lightning_pilot import storage
    out, index, count, run_id = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    written = []
    for n in range(count):
        record = {"run_id": run_id, "event": "heartbeat", "status": "running",
                  "variant": f"w{index}", "updates_done": n}
        written.append(str(storage.write_ledger_record(out + "/ledger", record)))
    try:
        storage.publish_bytes(str(index).encode(), out + "/claim.txt")
        claimed = True
    except FileExistsError:
        claimed = False
    print(json.dumps({"written": written, "claimed": claimed}))
    """
)


def test_eight_writer_processes_lose_and_overwrite_nothing(s3_env: dict[str, str]) -> None:
    out = f"s3://{BUCKET}/many-{uuid.uuid4().hex[:8]}"
    run_id, count = new_run_id(), 12
    env = {**os.environ, **s3_env}
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, out, str(index), str(count), run_id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for index in range(8)
    ]
    answers = []
    for writer in writers:
        stdout, stderr = writer.communicate(timeout=300)
        assert writer.returncode == 0, stderr[-2000:]
        answers.append(json.loads(stdout.strip().splitlines()[-1]))
    written = [path for answer in answers for path in answer["written"]]
    assert len(written) == len(set(written)) == 8 * count
    records = Ledger(out).records()
    assert len(records) == 8 * count
    assert records["record_id"].is_unique
    assert (
        sorted(records.groupby("variant")["updates_done"].apply(sorted).tolist())
        == [list(range(count))] * 8
    )
    # One name, eight creators: exactly one wins, and the object holds the winner's bytes.
    winners = [index for index, answer in enumerate(answers) if answer["claimed"]]
    assert len(winners) == 1
    claim = storage.location(f"{out}/claim.txt")
    assert claim.read_bytes() == str(winners[0]).encode()


def test_an_existing_key_is_refused_on_s3(s3_env: dict[str, str]) -> None:
    target = storage.location(f"s3://{BUCKET}/refuse-{uuid.uuid4().hex[:8]}/result.json")
    storage.publish_json({"first": True}, target)
    with pytest.raises(FileExistsError, match="refusing to overwrite s3://"):
        storage.publish_json({"first": False}, target)
    assert storage.read_json(target, max_bytes=100) == {"first": True}
    # The refusal is the server's, not only the check before it: a create that skips the
    # check is refused too (s3fs sends If-None-Match: *; moto answers 412).
    with pytest.raises(FileExistsError), target.fs.open(target.path, "xb") as handle:
        handle.write(b"{}")
    assert storage.read_json(target, max_bytes=100) == {"first": True}
    # A plot-like file drawn again on purpose replaces the older one.
    storage.publish_file(target.parent / "plot.png", lambda h: h.write(b"1"), replace=True)
    storage.publish_file(target.parent / "plot.png", lambda h: h.write(b"2"), replace=True)
    assert (target.parent / "plot.png").read_bytes() == b"2"


def test_show_reads_an_s3_output_folder(
    s3_pilot: tuple[str, Any, list[Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out, _, callbacks, _ = s3_pilot
    run_id = callbacks[0].run.run_id
    capsys.readouterr()
    assert main(["show", out]) == 0
    shown = capsys.readouterr().out
    assert f"from {out}\n" in shown
    assert f"Ledger (1 run(s)) from {out}/ledger" in shown
    assert run_id in shown
    assert "completed" in shown
    # One run folder, and the comparison of the ledger beside it.
    assert main(["show", f"{out}/runs/{run_id}"]) == 0
    assert main(["compare", out, "--metric", "train_loss"]) == 0
    assert main(["show", f"s3://{BUCKET}/nothing-here"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sheet_and_plot_write_next_to_an_s3_run_folder(
    s3_pilot: tuple[str, Any, list[Any], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out, _, callbacks, _ = s3_pilot
    _sheet_and_plots(out, callbacks[0].run.run_id, capsys, again=False)  # drawn again: memory
    # On S3 the refusal of an existing name is the server's: the sheet's own create refuses.
    sheet = storage.location(f"{out}/runs/{callbacks[0].run.run_id}/sheet.md")
    with pytest.raises(FileExistsError, match="refusing to overwrite s3://"):
        storage.publish_bytes(b"other", sheet)
    assert main(["sheet", f"s3://{BUCKET}/nothing-here"]) == 2
    assert main(["plot", f"s3://{BUCKET}/nothing-here"]) == 2
    assert capsys.readouterr().err.count("does not exist") == 2


def test_show_on_s3_stays_torch_free(s3_env: dict[str, str]) -> None:
    out = f"s3://{BUCKET}/light-{uuid.uuid4().hex[:8]}"
    storage.write_ledger_record(
        f"{out}/ledger", {"run_id": new_run_id(), "event": "start", "status": "running"}
    )
    code = (
        "import sys\nfrom lightning_pilot.cli import main\n"
        f"status = main(['show', {out!r}])\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'imported'\n"
        "sys.exit(status)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **s3_env},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Ledger (1 run(s))" in done.stdout


def test_the_memory_example_of_docs_storage_runs() -> None:
    text = (Path(__file__).parents[2] / "docs" / "storage.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    example = next(block for block in blocks if "memory://docs-example" in block)
    fs = storage.location("memory://docs-example").fs
    if fs.exists("/docs-example"):  # a second run of this test in the same process
        fs.rm("/docs-example", recursive=True)
    exec(compile(example, "docs/storage.md", "exec"), {})
    assert storage.read_json("memory://docs-example/pilot/claim.json", max_bytes=99) == {
        "winner": 1
    }
