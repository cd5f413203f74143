"""The pilot callbacks: each works alone and composes with the others through one PilotRun."""

from lightning_pilot.callbacks.phase_memory_monitor import PhaseCheckError, PhaseMemoryMonitor

__all__ = ["PhaseCheckError", "PhaseMemoryMonitor"]
