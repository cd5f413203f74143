"""The resume check: :class:`ResumeVerifier`; docs/architecture.md describes its modules."""

from lightning_pilot.resume.verifier import ResumeVerifier

__all__ = ["ResumeVerifier"]
