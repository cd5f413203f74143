"""A module of the user's whose import raises (for tests/test_cli_estimate.py)."""

from __future__ import annotations

import os

SETTINGS = os.environ["LIGHTNING_PILOT_TEST_SETTING_NOT_SET"]


def build() -> None:
    """Never reached: the import fails first."""
