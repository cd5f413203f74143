"""Shared fixtures: small real Trainers on CPU; one torch thread per process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

# The suite's models are tiny and it runs on 2 cores, often as 2 pytest-xdist workers beside
# the processes the tests start: a second intra-op thread per process only adds
# synchronisation. Set before any test (and inherited by every process a test starts).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# The files that take longest on 2 cores, longest first (each file's time summed over its tests in
# a run of the suite as CI runs it, `-n 2 --dist loadfile`). With xdist's reordering by test
# count switched off (below) files are handed out in collection order, so these start first,
# longest first, and no worker is left alone at the end with a long file while the other idles.
# Other files keep their order.
_LONGEST_FIRST = (
    "tests/resume/test_resume_verifier.py",
    "tests/resume/test_resume_ddp.py",
    "tests/integrations/test_fsspec.py",
    "tests/estimate/test_blocks.py",
    "tests/resume/test_child_progress.py",
    "tests/test_fault_drills.py",
    "tests/callbacks/test_effective_batch_accountant.py",
    "tests/estimate/test_grid.py",
    "tests/test_never_breaks_the_fit.py",
    "tests/conformance/test_conformance_clean.py",
    "tests/demo/test_pilot_demo.py",
    "tests/test_ledger_team.py",
    "tests/test_composition.py",
    "tests/integrations/test_lightning_cli.py",
    "tests/conformance/test_lifecycle.py",
    "tests/callbacks/test_divergence_ledger.py",
    "tests/estimate/test_validation.py",
    "tests/test_notebooks.py",
    "tests/report/test_plots.py",
    "tests/estimate/test_accuracy.py",
    "tests/integrations/test_loggers.py",
    "tests/resume/test_parent.py",
    "tests/resume/test_fit_loaders.py",
    "tests/test_storage.py",
    "tests/integrations/test_target_estimator.py",
    "tests/test_pilot.py",
    "tests/conformance/test_zoo_clean.py",
    "tests/conformance/test_conformance_planted.py",
)


# A factory module of tests/test_cli_estimate.py that raises when imported, on purpose (the
# user's own exception): never collected, doctests included.
collect_ignore = ["cli_estimate_broken.py"]


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --no-loadscope-reorder
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: position for position, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


if "PYTEST_XDIST_WORKER" in os.environ:
    # Two workers may start DDP process groups at the same time: with no MASTER_PORT each
    # group's launcher picks a free port of its own (a MASTER_PORT given to the whole run
    # would be the same port for both).
    os.environ.pop("MASTER_PORT", None)


@pytest.fixture
def make_trainer(tmp_path: Path) -> Any:
    """Build a quiet CPU Trainer rooted in ``tmp_path``; keyword arguments override defaults."""

    def make(**overrides: Any) -> pl.Trainer:
        options: dict[str, Any] = {
            "accelerator": "cpu",
            "devices": 1,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": tmp_path,
            "max_steps": 4,
            "limit_val_batches": 2,
        }
        options.update(overrides)
        return pl.Trainer(**options)

    return make
