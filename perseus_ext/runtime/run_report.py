"""What a rank reports about its run, and when: the summary on demand (built from a fresh typed
`RunSnapshot`), written once at close with the job's figures (`summary.close_summary`), or at once
without any collective when SIGINT/SIGTERM interrupts the run (`summary.write_interrupted_summary`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from perseus_ext.runtime.comm import ControlPlane
from perseus_ext.runtime.summary import RunSnapshot, build_summary, close_summary, write_interrupted_summary


class RunReport:
    """One rank's summary over its run (see the module docstring)."""

    def __init__(self, snapshot: Callable[[], RunSnapshot], summary_path: str | None) -> None:
        self._snapshot = snapshot
        self.summary_path = summary_path
        self.interrupted: dict[str, Any] | None = None  # the signal that interrupted the run
        self._written: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        """The summary written (at close or interruption), else one built now."""
        return self._written if self._written is not None else build_summary(self._snapshot())

    def interrupt(self, signal_name: str, iteration: int, phase: str, clocks_restored: bool) -> None:
        """SIGINT/SIGTERM (the clocks already restored): write the summary now, once."""
        if self.interrupted is not None:
            return
        self.interrupted = {"signal": signal_name, "at_iteration": iteration, "phase": phase,
                            "clocks_restored": clocks_restored}
        self._written = write_interrupted_summary(self._snapshot, self.interrupted, self.summary_path)

    def write_at_close(self, comm: ControlPlane, *, job_id: str, control_timeout_s: float,
                       control_plane_failed: bool) -> None:
        """The summary with the job's figures (a bounded wait for the other ranks)."""
        self._written = close_summary(comm, self._snapshot(), summary_path=self.summary_path, job_id=job_id,
                                      control_timeout_s=control_timeout_s,
                                      control_plane_failed=control_plane_failed, interrupted=self.interrupted)

