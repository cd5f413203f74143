"""Every pilot callback configured from a LightningCLI YAML file (``trainer.callbacks``).

Each test writes a real config file, hands it to :class:`lightning.pytorch.cli.LightningCLI`
(jsonargparse parses it against the callbacks' signatures), fits the demo LM and checks that
every callback holds exactly the configured values (none of them a default) and that the pilot
output folder holds what those values ask for. A bad value is refused while the file is parsed
and the classes built, before the Trainer trains: no pilot folder exists afterwards.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning_cli_hooks as hooks
import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI

import lightning_pilot
from lightning_pilot import demo
from lightning_pilot.callbacks import REGISTRY, Heartbeat
from lightning_pilot.core.divergence import DivergenceRules
from lightning_pilot.ledger import Ledger
from lightning_pilot.run import PilotCallback
from lightning_pilot.storage import read_phase_table, read_snapshot_table

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "pilot.yaml"
GUIDE = ROOT / "docs" / "lightning_cli.md"

#: A run id for ``derived_from`` (any well-formed id: the ledger only records it).
PARENT_RUN = "20260101T000000000Z-0123456789abcdef"

#: The trainer, model and data of every config here: the demo LM, 6 updates, 2 validations.
TRAINER = """\
seed_everything: 0
model:
  class_path: lightning_pilot.demo.TinyCausalLM
  init_args: {model}
data:
  class_path: lightning_pilot.demo.InstructionDataModule
  init_args: {data}
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 6
  val_check_interval: 3
  limit_val_batches: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
"""

#: Every option of the six callbacks of a pilot set, none at its default (but ``check_artifact``,
#: whose default ``true`` is what makes the resume check reload the ``export`` file).
PILOT_CALLBACKS = """\
  callbacks:
  - class_path: lightning_pilot.PhaseMemoryMonitor
    init_args:
      pilot_updates: 4
      sample_every: 3
      memory_updates: 3
      export: lightning_cli_hooks.export_weights
      on_fail: raise
      track_cpu: false
      adapter:
        class_path: lightning_pilot.core.batches.BatchAdapter
        init_args:
          ids: ids
          inputs: input_ids
          targets: labels
          attention_mask: attention_mask
      out_dir: {out}
  - class_path: lightning_pilot.BatchInspector
    init_args:
      batches: 3
      examples: 2
      decode: lightning_pilot.demo.decode
      group_fn: lightning_cli_hooks.example_group
      max_examples: 64
      vocab_size: {vocab}
      max_length: 24
      pad_token_id: {pad}
      padding_warn: 0.9
      adapter:
        class_path: lightning_pilot.core.batches.BatchAdapter
        init_args:
          targets: labels
          ignore_index: -100
      out_dir: {out}
  - class_path: lightning_pilot.EffectiveBatchAccountant
    init_args:
      keep: examples
      adapter:
        class_path: lightning_pilot.core.batches.BatchAdapter
        init_args:
          attention_mask:
            class_path: lightning_cli_hooks.BatchField
            init_args:
              key: attention_mask
      token_spread_ratio: 2.5
      out_dir: {out}
  - class_path: lightning_pilot.ResumeVerifier
    init_args:
      at_step: 3
      compare_steps: 1
      factory: lightning_cli_hooks:build
      fallback: in_process
      atol: 1.0e-6
      rtol: 1.0e-5
      epoch_boundary: false
      check_artifact: true
      export: lightning_cli_hooks.export_weights
      control_batches: 2
      timeout_s: 300.0
      adapter:
        class_path: lightning_pilot.core.batches.BatchAdapter
        init_args:
          ids: ids
      out_dir: {out}
  - class_path: lightning_pilot.ValidationPredictionWriter
    init_args:
      predictions_fn: lightning_cli_hooks.greedy_tokens
      predictions_key: tokens
      adapter:
        class_path: lightning_pilot.core.batches.BatchAdapter
        init_args:
          ids: ids
          targets: labels
          ignore_index: -1
      out_dir: {out}
  - class_path: lightning_pilot.DivergenceLedger
    init_args:
      experiment: yaml-config
      variant: small-lm
      seed: 7
      params: {{lr: 0.003, d_model: 32, schedule: constant, tied: false, layers: [1, 2]}}
      derived_from: {parent}
      rules:
        window: 4
        warmup: 2
        spike_factor: 50.0
        spike_patience: 2
        blowup_factor: 100.0
        blowup_cap: 1000.0
        blowup_patience: 2
        check_grad_norm: false
      action: record
      check_every: 2
      grad_norm_every: 3
      heartbeat:
        seconds: 3600.0
        updates: 2
      on_repeat: error
      val_metrics: [val_loss, val_acc]
      out_dir: {out}
  - class_path: lightning_pilot.PilotCallback
    init_args:
      out_dir: {out}
"""

#: What each callback must hold after parsing: attribute -> value (callables by identity).
EXPECTED: dict[str, dict[str, Any]] = {
    "PhaseMemoryMonitor": {
        "pilot_updates": 4,
        "sample_every": 3,
        "memory_updates": 3,
        "export": hooks.export_weights,
        "on_fail": "raise",
        "track_cpu": False,
        "adapter": "BatchAdapter(ids='ids', inputs='input_ids', targets='labels',"
        " attention_mask='attention_mask') ignore_index=-100",
    },
    "BatchInspector": {
        "batches": 3,
        "examples": 2,
        "decode": demo.decode,
        "group_fn": hooks.example_group,
        "max_examples": 64,
        "output_size": demo.VOCAB_SIZE,  # vocab_size
        "max_length": 24,
        "pad_token_id": demo.PAD_ID,
        "padding_warn": 0.9,
        "adapter": "BatchAdapter(targets='labels') ignore_index=-100",
    },
    "EffectiveBatchAccountant": {
        "keep": "examples",
        "token_spread_ratio": 2.5,
        "adapter": "BatchAdapter(attention_mask=BatchField('attention_mask')) ignore_index=-100",
    },
    "ResumeVerifier": {
        "at_step": 3,
        "compare_steps": 1,
        "factory": "lightning_cli_hooks:build",
        "fallback": "in_process",
        "atol": 1e-6,
        "rtol": 1e-5,
        "epoch_boundary": False,
        "check_artifact": True,
        "export": hooks.export_weights,
        "control_batches": 2,
        "timeout_s": 300.0,
        "adapter": "BatchAdapter(ids='ids') ignore_index=-100",
    },
    "ValidationPredictionWriter": {
        "predictions_fn": hooks.greedy_tokens,
        "predictions_key": "tokens",
        "adapter": "BatchAdapter(ids='ids', targets='labels') ignore_index=-1",
    },
    "DivergenceLedger": {
        "experiment": "yaml-config",
        "variant": "small-lm",
        "seed": 7,
        "params": {
            "lr": 0.003,
            "d_model": 32,
            "schedule": "constant",
            "tied": False,
            "layers": [1, 2],
        },
        "derived_from": PARENT_RUN,
        "rules": DivergenceRules(
            window=4,
            warmup=2,
            spike_factor=50.0,
            spike_patience=2,
            blowup_factor=100.0,
            blowup_cap=1000.0,
            blowup_patience=2,
            check_grad_norm=False,
        ),
        "action": "record",
        "check_every": 2,
        "grad_norm_every": 3,
        "heartbeat": Heartbeat(seconds=3600.0, updates=2),
        "on_repeat": "error",
        "val_metrics": ("val_loss", "val_acc"),
    },
    "PilotCallback": {},
}

#: OverfitTinySubset changes training, so it runs in a fit of its own.
OVERFIT_CALLBACKS = """\
  callbacks:
  - class_path: lightning_pilot.OverfitTinySubset
    init_args:
      num_examples: 4
      seed: 5
      max_steps: 8
      target_loss: 0.001
      target_fraction: 0.05
      required_recovery: 0.75
      check_every: 2
      batch_size: 2
      num_classes: {vocab}
      shift_labels: false
      init_tolerance: 3.0
      predict_fn: lightning_cli_hooks.aligned_logits
      adapter:
        class_path: lightning_pilot.core.batches.BatchAdapter
        init_args:
          ids: ids
          targets: labels
      out_dir: {out}
"""

OVERFIT_EXPECTED: dict[str, Any] = {
    "num_examples": 4,
    "seed": 5,
    "max_steps": 8,
    "target_loss": 0.001,
    "target_fraction": 0.05,
    "required_recovery": 0.75,
    "check_every": 2,
    "batch_size": 2,
    "num_classes": demo.VOCAB_SIZE,
    "shift_labels": False,
    "init_tolerance": 3.0,
    "predict_fn": hooks.aligned_logits,
    "adapter": "BatchAdapter(ids='ids', targets='labels') ignore_index=-100",
}


@pytest.fixture(autouse=True)
def _no_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI gets its arguments from ``args=``, not from pytest's command line."""
    monkeypatch.setattr(sys, "argv", ["train.py"])


def _flow(value: dict[str, Any]) -> str:
    """A YAML flow mapping on one line."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip()


def write_config(
    folder: Path, callbacks: str, data: dict[str, Any] | None = None, **fields: Any
) -> Path:
    """Write ``folder/config/pilot.yaml``: the demo LM with ``callbacks`` (a YAML block); the
    Trainer's root is ``folder/fit``, ``{out}`` is ``folder/fit/pilot-from-yaml``."""
    root = folder / "fit"
    data = hooks.DATA | (data or {})
    text = TRAINER.format(root=root, model=_flow(hooks.MODEL), data=_flow(data))
    options = {"out": root / "pilot-from-yaml", "vocab": demo.VOCAB_SIZE, "pad": demo.PAD_ID}
    text += callbacks.format(**(options | fields))
    path = folder / "config" / "pilot.yaml"
    path.parent.mkdir()
    path.write_text(text, encoding="utf-8")
    return path


def table(folder: Path) -> Any:
    """A detail table of a run (every writer's newest snapshot) as a DataFrame."""
    return read_snapshot_table(folder).to_pandas()


def held(callback: Any, name: str) -> Any:
    """What ``callback`` holds for the option ``name`` (a comparable form for nested objects)."""
    if name == "adapter":
        return f"{callback.adapter!r} ignore_index={callback.adapter.ignore_index}"
    if name == "rules":
        return callback.detector.rules
    return getattr(callback, name)


def settings(callbacks: list[Any]) -> dict[str, dict[str, Any]]:
    """The options of every pilot callback of a Trainer, by class name."""
    return {
        type(cb).__name__: {
            "out_dir": cb.out_dir,
            **{name: held(cb, name) for name in EXPECTED.get(type(cb).__name__, OVERFIT_EXPECTED)},
        }
        for cb in callbacks
        if isinstance(cb, PilotCallback)
    }


def assert_same(got: Any, want: Any, where: str) -> None:
    if callable(want) and not isinstance(want, type):
        assert got is want, f"{where}: {got!r} is not {want!r}"
    elif isinstance(want, float):
        assert type(got) is float, where
        assert got == want, f"{where}: {got!r} != {want!r}"
    else:
        assert type(got) is type(want), f"{where}: {type(got)} is not {type(want)}"
        assert got == want, f"{where}: {got!r} != {want!r}"


@contextlib.contextmanager
def parse_error() -> Iterator[io.StringIO]:
    """Expect jsonargparse to refuse the config: exit code 2, its message on stderr."""
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(stderr):
        yield stderr
    assert exited.value.code == 2


def test_every_option_of_the_pilot_set_reaches_its_callback_and_the_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    factory_log = tmp_path / "factory.log"
    monkeypatch.setenv(hooks.FACTORY_LOG, str(factory_log))
    config = write_config(tmp_path, PILOT_CALLBACKS, parent=PARENT_RUN)

    cli = LightningCLI(args=["fit", "--config", str(config)])

    out = (tmp_path / "fit" / "pilot-from-yaml").resolve()
    got = settings(cli.trainer.callbacks)
    assert list(got) == [*EXPECTED]  # the six pilot callbacks and the base class, in order
    for name, options in EXPECTED.items():
        assert got[name]["out_dir"] == tmp_path / "fit" / "pilot-from-yaml"
        for option, want in options.items():
            assert_same(got[name][option], want, f"{name}.{option}")
    callbacks = {type(cb).__name__: cb for cb in cli.trainer.callbacks}
    assert all(cb.run.out_dir == out for cb in callbacks.values() if isinstance(cb, PilotCallback))
    assert cli.trainer.global_step == 6

    # The files the configured values ask for.
    (run_dir,) = (out / "runs").iterdir()
    tables = sorted(p.name for p in run_dir.iterdir())
    assert tables == [
        "examples.parquet",
        "export",
        "model.parquet",
        "phases.parquet",
        "placement.parquet",
        "predictions.parquet",
        "resume",
        "resume.parquet",
        "updates.parquet",
    ]
    # export: the hook wrote the weights once, into the run's export folder.
    weights = torch.load(run_dir / "export" / "weights.pt", weights_only=True)
    assert set(weights) == set(cli.model.state_dict())

    # BatchInspector: 3 batches of 4 inspected, 2 examples kept per batch, decoded by demo.decode;
    # group_fn (id % 4) puts every group in all three splits, and the leakage check says so.
    examples = table(run_dir / "examples.parquet")
    assert examples["split"].tolist() == ["train", "train", "val", "val"]
    assert examples["input_text"].str.startswith("<bos> ").all()
    leakage = callbacks["BatchInspector"].checks["split_leakage"]
    assert leakage.verdict == "fail"
    assert "4 group(s) found in more than one split" in leakage.detail

    # EffectiveBatchAccountant: 6 updates of 4 examples; the tokens are the attention mask's
    # sum, read by the BatchField the adapter was given (326 real tokens in the 6 batches).
    updates = table(run_dir / "updates.parquet")
    assert updates["update"].tolist() == [1, 2, 3, 4, 5, 6]
    assert updates["examples"].tolist() == [4] * 6
    assert set(updates["tokens_source"]) == {"attention_mask"}
    assert updates["tokens"].sum() == 326
    assert callbacks["EffectiveBatchAccountant"].summary["keep"] == "examples"

    # ResumeVerifier: only the probe at update 3 (no epoch-boundary probe), one compared update,
    # rebuilt in a new process by the factory; it passes with stateful loaders.
    assert sorted(p.name for p in (run_dir / "resume").glob("*.ckpt")) == [
        "final-attempt-1.ckpt",
        "mid_epoch-step-3.ckpt",
    ]
    resume = table(run_dir / "resume.parquet")
    assert set(resume["checkpoint_step"].dropna()) == {3}
    pids = {int(line) for line in factory_log.read_text().split()}
    assert pids
    assert os.getpid() not in pids
    phases = read_phase_table(run_dir).set_index("phase")
    assert phases.loc["resume", "verdict"] == "pass", phases.loc["resume", "checks"]

    # ValidationPredictionWriter: greedy tokens of 2 validations x 2 batches x 4 examples.
    predictions = Ledger(out).predictions(run_dir.name)  # one file, checked against its sha256
    assert len(predictions) == 16
    assert sorted(set(predictions["step"])) == [3, 6]
    pairs = zip(predictions["prediction"], predictions["target"], strict=True)
    assert all(len(p) == len(t) == len(p.tolist()) for p, t in pairs)

    # DivergenceLedger: the start, a heartbeat at the evaluations of updates 2, 4 and 6 (every
    # 2 updates; 3600 s is never reached), the end; check_every=2 reads 2 losses at each one.
    ledger = Ledger(out)
    records = ledger.records().sort_values("written_at")
    assert records["event"].tolist() == ["start", "heartbeat", "heartbeat", "heartbeat", "end"]
    beats = records[records["event"] == "heartbeat"]
    assert [len(curve) for curve in beats["train_loss"]] == [2, 2, 2]
    (row,) = ledger.runs().to_dict("records")
    assert (row["experiment"], row["variant"], row["seed"]) == ("yaml-config", "small-lm", 7)
    assert row["derived_from_run_id"] == PARENT_RUN
    assert row["params_json"] == (
        '{"d_model":32,"layers":[1,2],"lr":0.003,"schedule":"constant","tied":false}'
    )
    assert (row["status"], row["stop_cause"], row["stop_step"]) == ("completed", "max_steps", 6)

    # LightningCLI saved the config it ran; parsed again, it gives the same callbacks.
    saved = yaml.safe_load((tmp_path / "fit" / "config.yaml").read_text())
    for fit_only in ("ckpt_path", "weights_only"):  # options of the fit command, not of the CLI
        saved.pop(fit_only)
    (tmp_path / "config" / "saved.yaml").write_text(yaml.safe_dump(saved))
    again = LightningCLI(run=False, args=["--config", str(tmp_path / "config" / "saved.yaml")])
    assert settings(again.trainer.callbacks) == got


def test_overfit_tiny_subset_from_yaml_in_a_fit_of_its_own(tmp_path: Path) -> None:
    # Examples of one length (4 symbols: 12 tokens), so both subset batches of 2 have one width.
    same_length = {"min_symbols": 4, "max_symbols": 4}
    config = write_config(tmp_path, OVERFIT_CALLBACKS, data=same_length)

    cli = LightningCLI(args=["fit", "--config", str(config), "--trainer.max_steps", "50"])

    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, PilotCallback)]
    for option, want in OVERFIT_EXPECTED.items():
        assert_same(held(callback, option), want, f"OverfitTinySubset.{option}")
    # The callback's budget of 8 updates stops the fit, not the Trainer's 50; the loss target
    # 0.001 is out of reach in 8 updates.
    assert cli.trainer.global_step == 8
    assert callback.checks["loss_target"].verdict == "fail"
    assert "never reached the target 0.001" in callback.checks["loss_target"].detail
    # 4 examples in 2 batches of 2, one batch per update; scored every 2 updates with the
    # aligned logits of predict_fn (shift_labels=False).
    (run_dir,) = (tmp_path / "fit" / "pilot-from-yaml" / "runs").iterdir()
    overfit = table(run_dir / "overfit.parquet")
    assert overfit["step"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert set(overfit["target_loss"]) == {0.001}
    assert [len(ids) for ids in overfit["subset_ids"]] == [4] * 8
    scored = overfit.dropna(subset=["score"])
    assert scored["step"].tolist() == [2, 4, 6, 8]
    assert scored["score"].between(0, 1).all()
    assert callback.checks["targets_recovered"].verdict != "not_checked"
    phases = read_phase_table(run_dir)
    assert phases["phase"].tolist() == ["overfit"]


@pytest.mark.parametrize(
    ("callback", "options", "message"),
    [
        # Refused by jsonargparse against the type hints, while parsing.
        ("PhaseMemoryMonitor", "pilot_updates: three", 'Parser key "pilot_updates"'),
        ("PhaseMemoryMonitor", "pilot_updates: 2.5", "Expected a <class 'int'>. Got value: 2.5"),
        ("PhaseMemoryMonitor", "on_fail: crash", "Got value: crash"),
        ("PhaseMemoryMonitor", "pilot_update: 3", "Option 'pilot_update' is not accepted"),
        (
            "PhaseMemoryMonitor",
            "export: lightning_cli_hooks.missing",
            "lightning_cli_hooks.missing",
        ),
        ("EffectiveBatchAccountant", "keep: steps", "Got value: steps"),
        ("DivergenceLedger", "variant: v", "the following arguments are required: experiment"),
        ("DivergenceLedger", "{experiment: e, variant: v, val_metrics: val_loss}", "val_metrics"),
        ("DivergenceLedger", "{experiment: e, variant: v, heartbeat: {second: 1}}", "heartbeat"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_while_parsing(
    tmp_path: Path, callback: str, options: str, message: str
) -> None:
    block = f"  callbacks:\n  - class_path: lightning_pilot.{callback}\n    init_args: {{}}\n"
    if options.startswith("{"):
        block = block.replace("{}", options)
    else:
        block = block.replace("{}", f"\n      {options}")
    config = write_config(tmp_path, block.replace("{", "{{").replace("}", "}}"))

    with parse_error() as stderr:
        LightningCLI(args=["fit", "--config", str(config)])

    assert f"Problem with given class_path 'lightning_pilot.{callback}'" in stderr.getvalue()
    assert message in stderr.getvalue()
    assert not (tmp_path / "fit").exists()


@pytest.mark.parametrize(
    ("callback", "options", "message"),
    [
        # Well typed, refused by the callback's own check with the project's message.
        (
            "PhaseMemoryMonitor",
            "{pilot_updates: 1}",
            "PhaseMemoryMonitor(pilot_updates=1) is invalid: expected an integer >= 2",
        ),
        (
            "PhaseMemoryMonitor",
            "{pilot_updates: 2, memory_updates: 3}",
            "PhaseMemoryMonitor(memory_updates=3) is invalid: expected an integer from 1 to 2",
        ),
        (
            "ResumeVerifier",
            "{factory: lightning_cli_hooks.build}",
            "ResumeVerifier(factory='lightning_cli_hooks.build') is invalid: expected"
            " 'package.module:function'",
        ),
        (
            "DivergenceLedger",
            "{experiment: e, variant: v, heartbeat: {seconds: -1}}",
            "Heartbeat(seconds=-1.0) is invalid: expected a finite number >= 0 (seconds)",
        ),
        (
            "DivergenceLedger",
            "{experiment: e, variant: v, rules: {spike_factor: 1.0}}",
            "DivergenceRules(spike_factor=1.0) is invalid: expected a finite number > 1",
        ),
        (
            "DivergenceLedger",
            "{experiment: e, variant: v, derived_from: run-7}",
            "DivergenceLedger(derived_from='run-7') is invalid: expected a run id",
        ),
        (
            "BatchInspector",
            "{num_classes: 3, vocab_size: 30}",
            "BatchInspector(num_classes=3, vocab_size=30) is invalid: expected one of them",
        ),
        (
            "BatchInspector",
            "{adapter: {class_path: lightning_pilot.core.batches.BatchAdapter,"
            " init_args: {ids: ''}}}",
            "BatchAdapter(ids='') is invalid: expected a dict key (str)",
        ),
        (
            "BatchInspector",
            "{adapter: {class_path: lightning_pilot.core.batches.BatchAdapter,"
            " init_args: {targets: 'lightning_cli_hooks:no_such_function'}}}",
            "BatchAdapter(targets='lightning_cli_hooks:no_such_function') is invalid: expected"
            " 'package.module:function', the import path of a callable batch -> value",
        ),
        (
            "OverfitTinySubset",
            "{required_recovery: 1.5}",
            "OverfitTinySubset(required_recovery=1.5) is invalid",
        ),
    ],
)
def test_a_value_the_callback_refuses_fails_before_training(
    tmp_path: Path, callback: str, options: str, message: str
) -> None:
    block = f"  callbacks:\n  - class_path: lightning_pilot.{callback}\n    init_args: {options}\n"
    config = write_config(tmp_path, block.replace("{", "{{").replace("}", "}}"))

    with pytest.raises(ValueError, match=re.escape(message)):
        LightningCLI(args=["fit", "--config", str(config)])

    assert not (tmp_path / "fit").exists()


def test_a_batch_adapter_field_given_as_a_function_import_path(tmp_path: Path) -> None:
    # "package.module:function" (a colon) names a function; a string without one stays a key.
    block = """\
  callbacks:
  - class_path: lightning_pilot.BatchInspector
    init_args:
      adapter:
        class_path: lightning_pilot.core.batches.BatchAdapter
        init_args:
          ids: ids
          targets: lightning_cli_hooks:labels_of
"""
    config = write_config(tmp_path, block)

    cli = LightningCLI(run=False, args=["--config", str(config)])

    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, PilotCallback)]
    assert callback.adapter._specs["ids"] == "ids"
    assert callback.adapter._specs["targets"] is hooks.labels_of
    cli.datamodule.setup("fit")
    batch = next(iter(cli.datamodule.train_dataloader()))
    view = callback.adapter.view(batch)
    assert view.targets is batch["labels"]
    assert view.loss_tokens == int((batch["labels"] != -100).sum())
    # The config LightningCLI saves keeps the import path as written; parsed again, it names
    # the same function.
    saved = yaml.safe_load(cli.parser.dump(cli.config))
    fields = saved["trainer"]["callbacks"][0]["init_args"]["adapter"]["init_args"]
    assert (fields["ids"], fields["targets"]) == ("ids", "lightning_cli_hooks:labels_of")
    again_path = tmp_path / "config" / "saved.yaml"
    again_path.write_text(yaml.safe_dump(saved))
    again = LightningCLI(run=False, args=["--config", str(again_path)])
    (rebuilt,) = [cb for cb in again.trainer.callbacks if isinstance(cb, PilotCallback)]
    assert rebuilt.adapter._specs == callback.adapter._specs


def guide_blocks() -> dict[str, str]:
    """The code blocks of docs/lightning_cli.md that name a file on their first line."""
    blocks = re.findall(r"```(?:python|yaml)\n(# ([\w.]+)\n.*?)```", GUIDE.read_text(), re.S)
    return {name: text for text, name in blocks}


def test_the_guide_and_its_example_config_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = guide_blocks()
    assert sorted(blocks) == ["overfit.yaml", "pilot_hooks.py", "train.py"]
    for name, text in blocks.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    example = yaml.safe_load(EXAMPLE.read_text())
    named = {entry["class_path"] for entry in example["trainer"]["callbacks"]}
    assert named == {f"lightning_pilot.{e.name}" for e in REGISTRY if e.option is not None}

    # python train.py fit --config docs/examples/pilot.yaml, as the guide says.
    root = tmp_path / "pilot-run"
    argv = ["train.py", "fit", "--config", str(EXAMPLE), f"--trainer.default_root_dir={root}"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(tmp_path / "train.py"), run_name="__main__")

    (run_dir,) = (root / "pilot" / "runs").iterdir()
    phases = read_phase_table(run_dir)
    assert set(phases["phase"]) >= {
        "setup",
        "data",
        "forward",
        "backward",
        "optimizer_step",
        "validation",
        "checkpoint_save",
        "export",
        "resume",
        "checkpoint_load",
    }
    failed = phases[phases["verdict"] == "fail"]
    assert failed.empty, failed[["phase", "reason"]]
    # The module LightningCLI built is rebuilt in the new process from the checkpoint alone (no
    # factory, no fallback): the resume is proven.
    resume = phases[phases["phase"] == "resume"].iloc[0]
    assert resume["verdict"] == "pass", resume["reason"]
    assert len(Ledger(root / "pilot").predictions(run_dir.name)) == 2 * 2 * 8
    for name in ("examples", "updates", "placement", "model"):
        assert len(table(run_dir / f"{name}.parquet")) > 0, name
    # BatchInspector read the targets through pilot_hooks:labels_of (a function by import path).
    examples = table(run_dir / "examples.parquet")
    assert examples["target_tokens"].map(len).gt(0).all()
    (row,) = Ledger(root / "pilot").runs().to_dict("records")
    assert row["status"] == "completed"

    # The overfit check in a fit of its own: the same file with overfit.yaml on top.
    root = tmp_path / "overfit-run"
    argv[2:] = ["--config", str(EXAMPLE), "--config", "overfit.yaml"]
    argv.append(f"--trainer.default_root_dir={root}")
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(tmp_path / "train.py"), run_name="__main__")

    (run_dir,) = (root / "pilot" / "runs").iterdir()
    assert "overfit" in set(read_phase_table(run_dir)["phase"])
    assert len(table(run_dir / "overfit.parquet")) > 0
    assert not (root / "pilot" / "ledger").exists()  # the pilot set's callbacks were replaced


def test_lightning_pilot_names_are_class_paths() -> None:
    """``class_path: lightning_pilot.<Name>`` resolves to the callback class itself."""
    for entry in REGISTRY:
        assert getattr(lightning_pilot, entry.name) is entry.load()
