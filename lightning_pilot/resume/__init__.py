"""The resume check: :class:`ResumeVerifier` (``verifier``), the typed request and result that
cross the process boundary as JSON (``protocol``), the training process's side (``parent``), the
new process (``child``, ``python -m lightning_pilot.resume.child REQUEST``) and what both sides
record (``replay``).
"""

from lightning_pilot.resume.verifier import ResumeVerifier

__all__ = ["ResumeVerifier"]
