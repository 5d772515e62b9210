"""A slowed pipeline's return to its fastest plan, judged as the device runs, never on the host.

Why off the training thread: the verdict reads an iteration's wait at the gradient sync, which
only the device's record of that iteration holds, and the host launches the next iteration long
before the device finishes this one. Waiting for the record would synchronise the host with the
device in a deployed iteration. Instead the controller's observer thread hands every observed
marker to `RecoveryJudge` as the device reaches it; the judge applies `RecoveryWatch`'s rule to
each held iteration as its end is observed and, on "this pipeline became the slowest",
overrides the straggler episode at once (`FrequencyController.recover`): the computations the
device has not started yet run the fastest plan's clocks (`ClockSequencer`'s recovery program),
although the training thread queued the slowed plan's. The training thread learns the verdict at
a later iteration boundary without waiting (`take`), and `PlanDeployment` deploys the fastest
plan from there on.

The same override serves the straggler's own word (`recovery_signal.py`): the straggler
pipeline's ranks see their computations run at model speed again and post that to the rendezvous
store; the slowed pipelines' background threads read it and report it here, within the
recovered iteration itself; and its word that it still runs slow keeps a wait that dips on a
crowded host from returning a pipeline while its straggler lasts (`still_slow`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from perseus_ext.runtime.recorder import COMPUTE_END, END
from perseus_ext.runtime.straggler import VERDICT_LEAD_SHARE, HeldStraggler, RecoveryWatch

if TYPE_CHECKING:
    from perseus_ext.actuation.controller import FrequencyController
    from perseus_ext.actuation.observer import Observation

KEPT_ITERATIONS = 16  # held iterations launched but not yet judged, at most (older ones are dropped)


@dataclass(frozen=True)
class HeldIteration:
    """An iteration launched while a plan slowed for a measured straggler was in force: what its
    verdict needs, fixed at launch (the training thread moves on before the device runs it)."""

    iteration: int
    episode: int  # the straggler episode (one per stretch of held plans on this rank)
    held: HeldStraggler
    free_wait_s: float  # the rank's wait with nobody to wait for, when the episode began
    planned_extra_s: float  # the iteration's model time above the fastest plan
    runs_held_plan: bool  # the held plan itself (not a baseline probe): it may calibrate the watch


@dataclass(frozen=True)
class Verdict:
    """The straggler of `episode` has recovered, as `iteration` told (its wait at the gradient
    sync on this rank, or the straggler's own post during that iteration)."""

    episode: int
    iteration: int
    reason: str


class RecoveryJudge:
    """Judges held iterations as the device ends them; thread-safe (the training thread registers
    what it launches and takes verdicts, the observer thread judges, the signal thread reports)."""

    def __init__(self, controller: FrequencyController | None = None) -> None:
        self._controller = controller
        self._lock = threading.Lock()
        self._launched: dict[int, HeldIteration] = {}
        self._compute_ends: dict[int, float] = {}
        self._verdicts: list[Verdict] = []
        self._watch = RecoveryWatch()
        self._episode: int | None = None  # the episode the watch's calibration belongs to
        self._episodes = 0
        self.overridden: set[int] = set()
        self._straggler_slow_in: int | None = None  # the latest iteration the straggler said it ran slow in
        if controller is not None and controller.observer is not None:
            controller.observer.listen(self.observed)  # called on the observer's thread

    def new_episode(self) -> int:
        """A fresh straggler episode number, never used before on this rank (the controller's
        overrides outlive a redeployment)."""
        with self._lock:
            self._episodes += 1
            return self._episodes

    def expect(self, launched: HeldIteration) -> None:
        """The training thread launched a held iteration (non-blocking)."""
        with self._lock:
            self._launched[launched.iteration] = launched
            for stale in [i for i in self._launched if i < launched.iteration - KEPT_ITERATIONS]:
                del self._launched[stale]

    def observed(self, observation: Observation) -> None:
        """The device reached an observed marker (the observer's thread): a held iteration's
        compute end is noted, its end judged."""
        tag = observation.tag
        if not (isinstance(tag, tuple) and len(tag) == 2 and isinstance(tag[0], int)):
            return
        iteration, what = tag
        verdict = None
        with self._lock:
            if iteration not in self._launched:
                return
            if what == COMPUTE_END:
                self._compute_ends[iteration] = observation.device_time_s
            elif what == END:
                launched = self._launched.pop(iteration)
                compute_end = self._compute_ends.pop(iteration, None)
                for stale in [i for i in self._compute_ends if i < iteration]:
                    del self._compute_ends[stale]
                if compute_end is not None:
                    verdict = self._judge(launched, observation.device_time_s - compute_end)
        if verdict is not None:
            self.report(verdict)

    def _judge(self, launched: HeldIteration, wait_s: float) -> Verdict | None:
        """`RecoveryWatch`'s rule on one held iteration (lock held)."""
        if launched.episode in self.overridden:
            return None
        watch = self._watch
        if launched.episode != self._episode:
            watch.hold(None)
            watch.hold(launched.held, launched.free_wait_s)
            self._episode = launched.episode
        else:
            watch.hold(launched.held)  # a renewal keeps this rank's calibration
        extra = launched.planned_extra_s
        if launched.runs_held_plan and watch.observe_held(wait_s, extra):
            return None
        threshold = watch.threshold_s(extra)
        if threshold is None or not watch.became_slowest(wait_s, extra):
            return None
        if self._said_slow_in(launched.iteration):
            return None  # the straggler said it still ran slow then: the dip was this host's
        held_wait = watch.free_wait_s + (threshold - watch.free_wait_s) / VERDICT_LEAD_SHARE  # the predicted wait
        return Verdict(launched.episode, launched.iteration,
                       f"this pipeline became the slowest: it waited {1000 * wait_s:.1f} ms at the gradient sync "
                       f"in iteration {launched.iteration}, {1000 * held_wait:.1f} ms while the straggler lasted")

    def report(self, verdict: Verdict) -> None:
        """A verdict from any thread: the episode is overridden on the device at once (the
        first verdict of an episode counts), and the training thread takes it later."""
        with self._lock:
            if verdict.episode in self.overridden:
                return
            self.overridden.add(verdict.episode)
            self._verdicts.append(verdict)
        if self._controller is not None:
            self._controller.recover(verdict.episode)

    def still_slow(self, iteration: int) -> None:
        """The straggler pipeline said its computations still ran slow in `iteration` (any
        thread): no wait of that iteration or an earlier one returns this pipeline."""
        with self._lock:
            self._straggler_slow_in = max(iteration, self._straggler_slow_in or iteration)

    def straggler_slow_in(self, iteration: int) -> bool:
        """Whether the straggler said it still ran slow in `iteration` or later."""
        with self._lock:
            return self._said_slow_in(iteration)

    def _said_slow_in(self, iteration: int) -> bool:
        """`straggler_slow_in` with the lock held."""
        return self._straggler_slow_in is not None and self._straggler_slow_in >= iteration

    def take(self, episode: int) -> Verdict | None:
        """The verdict on `episode`, if one came (never blocks); verdicts on other episodes
        are dropped."""
        with self._lock:
            verdicts, self._verdicts = self._verdicts, []
        return next((v for v in verdicts if v.episode == episode), None)
