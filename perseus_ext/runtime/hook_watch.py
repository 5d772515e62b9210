"""What a rank learns from its hooks arriving, or not: the silence guard and the capture probe.

Hooks that fall silent (a CUDA graph replay, an unhooked schedule) must never leave a clock held:
`SilenceGuard` (actuation/silence.py) releases it once no hook came for longer than its bound. A
hook that runs while a CUDA stream is capturing a graph does nothing on the device (a marker
recorded now would belong to the graph) and the rank falls back, once (`CAPTURE_REASON`).
"""

from __future__ import annotations

from collections.abc import Callable

from perseus_ext.actuation.silence import SilenceGuard, SilentEpisode
from perseus_ext.runtime.capture import capture_probe
from perseus_ext.runtime.summary import SilenceReport

CAPTURE_REASON = ("a perseus-ext hook ran while a CUDA stream was capturing a CUDA graph: the graph's replays "
                  "run without hooks, so no planned clock can follow them (megatron-core's full-iteration "
                  "graph is supported through its replay, docs/megatron.md; per-layer graphs capture outside "
                  "the hooks)")


class HookWatch:
    """The silence guard over one rank's hooks and the count of hooks run during a capture."""

    def __init__(self, current_clock: Callable[[], int | None], on_silent: Callable[[SilentEpisode], None],
                 fall_back: Callable[[str], None]) -> None:
        self.silence = SilenceGuard(current_clock, on_silent)
        self._capturing = capture_probe()
        self._fall_back = fall_back
        self.captured_hooks = 0  # hooks that ran during a CUDA graph capture (and did nothing)

    def entered(self, *, starts_iteration: bool = False) -> bool:
        """A hook ran (the guard hears it); True when it must do nothing (a capture runs)."""
        if starts_iteration:
            self.silence.iteration_started()
        else:
            self.silence.heartbeat()
        return self.capture_noticed()

    def capture_noticed(self) -> bool:
        """True while a CUDA graph is being captured; the first one makes the rank fall back."""
        if not self._capturing():
            return False
        self.captured_hooks += 1
        self._fall_back(CAPTURE_REASON)
        return True

    def report(self) -> SilenceReport:
        silence = self.silence
        return SilenceReport(silence.bound_s, silence.expected_iteration_s, tuple(silence.episodes),
                             self.captured_hooks)

    def close(self) -> None:
        self.silence.close()
