"""The pilot callbacks: each works alone and composes with the others through one PilotRun."""

from lightning_pilot.callbacks.batch_inspector import BatchInspector
from lightning_pilot.callbacks.divergence_ledger import DivergenceLedger
from lightning_pilot.callbacks.effective_batch_accountant import EffectiveBatchAccountant
from lightning_pilot.callbacks.overfit_tiny_subset import OverfitTinySubset
from lightning_pilot.callbacks.phase_memory_monitor import PhaseCheckError, PhaseMemoryMonitor
from lightning_pilot.callbacks.resume_verifier import ResumeVerifier

__all__ = [
    "BatchInspector",
    "DivergenceLedger",
    "EffectiveBatchAccountant",
    "OverfitTinySubset",
    "PhaseCheckError",
    "PhaseMemoryMonitor",
    "ResumeVerifier",
]
