"""`lightning-pilot estimate` on what a user brings: a batch with no sequence dimension prints
`as given` and `n/m`, never `None` or `nan`; a factory (or its module) that raises is reported
as the user's exception, with the frames of their code, exit 2 (docs/cli.md, `estimate`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from lightning_pilot.cli import EXIT_OK, EXIT_USAGE, main

FACTORIES = Path(__file__).with_name("cli_estimate_factories.py")


def line_of(text: str) -> int:
    """The line of ``FACTORIES`` that holds ``text``."""
    lines = FACTORIES.read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)


def test_a_batch_without_a_sequence_prints_as_given_and_n_m(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        ["estimate", "cli_estimate_factories:classifier", "--target", "L4-24GB",
         "--micro-batch", "4"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert not re.search(r"\b(None|nan|NaN)\b", out), out
    (row,) = [line for line in out.splitlines() if line.startswith("L4-24GB")]
    assert row.split()[:5] == ["L4-24GB", "bf16-mixed", "4", "as", "given"]
    assert row.rstrip().endswith("ok")
    (largest,) = [line for line in out.splitlines() if line.startswith("largest on")]
    # The search runs up to max_micro_batch (1024) on the tiny classifier; no sequence to grow.
    assert largest == (
        "largest on L4-24GB (bf16-mixed, checkpointing off): micro-batch 1024 at seq as given;"
        " seq n/m (the batch has no sequence dimension) (ok)"
    )


def test_a_factory_that_raises_is_reported_as_the_users(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["estimate", "cli_estimate_factories:raises"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    lines = err.splitlines()
    assert lines[0] == (
        "lightning-pilot: FACTORY 'cli_estimate_factories:raises' raised"
        " cli_estimate_factories.TokenizerMissingError: no tokenizer at data/tokenizer.json"
        " (from your code, not a lightning-pilot bug; the last frames of its traceback follow)"
    )
    assert "unexpected error" not in err
    assert "please report" not in err
    # The traceback's tail: the factory's frame, then the frame that raised, in their file.
    frames = [line.strip() for line in lines[1:] if line.strip().startswith("File ")]
    assert frames == [
        f'File "{FACTORIES}", line {line_of("return _load_tokenizer(")}, in raises',
        f'File "{FACTORIES}", line {line_of("raise TokenizerMissingError(")}, in _load_tokenizer',
    ]
    assert lines[-1].strip() == 'raise TokenizerMissingError(f"no tokenizer at {path}")'
    assert "cli.py" not in err


def test_a_factory_misusing_the_library_is_still_the_users(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["estimate", "cli_estimate_factories:data_too_small"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(
        "lightning-pilot: FACTORY 'cli_estimate_factories:data_too_small' raised ValueError:"
        " ClassificationDataModule(dataset_size=4) is invalid"
    )
    files = re.findall(r'File "([^"]+)"', err)
    assert files[0] == str(FACTORIES)  # their call first, then the library frames it reached
    assert any(name.endswith("lightning_pilot/demo/_data.py") for name in files[1:])


def test_a_module_that_raises_on_import_is_the_users_a_missing_one_is_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["estimate", "cli_estimate_broken:build"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "lightning-pilot: importing FACTORY 'cli_estimate_broken:build' raised KeyError:"
        " 'LIGHTNING_PILOT_TEST_SETTING_NOT_SET' (from your code, not a lightning-pilot bug; the"
        " last frames of its traceback follow)"
    )
    assert re.search(r'File ".*cli_estimate_broken\.py", line 7, in <module>', err)
    # Not there at all: a usage error on one line, no frames.
    assert main(["estimate", "cli_estimate_factories:missing"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == (
        "lightning-pilot: FACTORY 'cli_estimate_factories:missing' could not be imported:"
        " module 'cli_estimate_factories' has no attribute 'missing'\n"
    )


def lm() -> tuple[Any, Any]:
    """FACTORY of the tests below: the demo LM (one block) and one real batch of its data."""
    from lightning_pilot.demo import InstructionDataModule, TinyCausalLM

    data = InstructionDataModule(dataset_size=8, batch_size=2, max_length=16)
    data.setup("fit")
    module = TinyCausalLM(d_model=16, n_heads=2, n_layers=1, max_length=16)
    return module, next(iter(data.train_dataloader()))


def test_checkpointing_all_prints_and_writes_each_mode_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["estimate", "test_cli_estimate:lm", "--target", "L4-24GB", "--micro-batch", "2",
         "--seq-len", "16", "--checkpointing", "all", "--no-largest",
         "--checkpoint-class", "lightning_pilot.demo.lm:_Block", "--timeout", "600",
         "--capacity-factor", "1.25", "--out", str(tmp_path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    rows = [line.split() for line in out.splitlines() if line.startswith("L4-24GB")]
    # target, precision, micro-batch, seq, ckpt, ...
    assert [row[4] for row in rows] == ["off", "full", "selective"], out
    written = pd.read_parquet(tmp_path / "estimate.parquet")
    assert set(written["status"]) == {"ok"}
    assert list(dict.fromkeys(written["checkpointing"])) == ["off", "full", "selective"]
    backward = written[written["phase"] == "backward"].set_index("checkpointing")
    saved = backward["activations_bytes"]
    assert saved["full"] < saved["selective"] < saved["off"], saved.to_dict()


@pytest.mark.parametrize(
    ("argument", "said"),
    [
        (["--capacity-factor", "0.5"], "estimate(capacity_factor=0.5) is invalid"),
        (["--timeout", "0"], "estimate(timeout=0.0) is invalid"),
        (["--checkpointing", "some"], "argument --checkpointing: invalid choice: 'some'"),
        (["--capacity-factor", "many"], "argument --capacity-factor: invalid float value"),
    ],
)
def test_bad_estimate_options_are_usage_errors(
    argument: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["estimate", "test_cli_estimate:lm", "--no-largest", *argument])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    (line,) = err.splitlines()
    assert line.startswith("lightning-pilot: "), err
    assert said in line, err
