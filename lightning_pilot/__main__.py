"""``python -m lightning_pilot``: the same as the ``lightning-pilot`` command."""

from lightning_pilot.cli import main

raise SystemExit(main())
