"""The version of lightning-pilot (read by the build backend and by ``--version``)."""

__version__ = "0.4.0"
