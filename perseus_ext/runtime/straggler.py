"""Straggler detection with hysteresis: how much longer than this pipeline the slowest one takes.

Pipelines compare *normalised* compute times: a pipeline's measured compute time (before the
gradient all-reduce wait) minus the extra model time of the plan it runs (`plan.time -
fastest.time`), i.e. what it would take at its fastest plan. Subtracting (rather than scaling)
matches how plans change an iteration: they lengthen the computations, while communication and
optimizer overheads stay the same. A pipeline that slowed down on purpose therefore never looks
like a straggler itself, and the straggler's own ratio is 1, so it keeps the fastest plan.
The ratio fed to the tracker is 1 + (straggler time - own time) / fastest plan time: the factor by
which this pipeline's plan may be longer than the fastest plan without slowing the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SlowdownTracker:
    """Turns measured ratios into the slowdown factor a pipeline should plan for.

    threshold: a ratio must exceed 1 + threshold before a pipeline slows down at all.
    hysteresis: once slowed, the target only moves when the ratio changes by more than this
    (relative), and recovery happens below 1 + threshold - hysteresis, so plans do not flap.
    confirmations: how many checks in a row must ask for a slower plan before it happens, so a
    transient hiccup (a slow checkpoint write, a noisy neighbour) slows nothing down. Moves to
    a faster plan happen at once: lagging there would slow the whole job.
    """

    threshold: float
    hysteresis: float
    confirmations: int = 1
    factor: float = 1.0  # the slowdown currently planned for (1.0 = fastest plan)
    _pending: int = 0

    def update(self, ratio: float) -> bool:
        """Feed the latest straggler ratio; True when `factor` changed."""
        slowed = self.factor > 1.0
        if not slowed:
            target = ratio if ratio >= 1.0 + self.threshold else 1.0
        elif ratio < 1.0 + self.threshold - self.hysteresis:
            target = 1.0
        elif abs(ratio / self.factor - 1.0) > self.hysteresis:
            target = ratio
        else:
            target = self.factor
        if target == self.factor:
            self._pending = 0
            return False
        self._pending += 1
        if target > self.factor and self._pending < self.confirmations:
            return False
        self._pending = 0
        self.factor = target
        return True

    def recovered(self) -> None:
        """The pipeline found itself the slowest between checks (`RecoveryWatch`) and went back
        to its fastest plan: slowing down again takes `confirmations` checks in a row, as it
        does from the start, so a verdict that came too early cannot make plans flap."""
        self.factor = 1.0
        self._pending = 0


FREE_WAIT_SAMPLES = 16  # recent waits at the fastest plan with no straggler, per rank
FREE_WAIT_QUANTILE = 0.25  # of those: the wait with nobody to wait for, the host's noise mostly left out
NOISE_QUANTILE = 0.5  # of the changes from one free wait to the next: how far one iteration strays
HELD_CALIBRATION = 2  # held iterations whose median wait calibrates a rank's own lead
NOISE_LEADS = 2.0  # a verdict needs the predicted lead above this many times the spread
# Where between the free wait and the predicted lead a wait says "nobody is slower any more":
# near the free wait, since a straggler that only got a little faster (its lead halved) still
# leads, and slowing down for it again would take confirmed checks. A verdict also needs evidence
# worth EVIDENCE_LEAD_SHARE of the lead: a wait that falls all the way to the free wait gives
# VERDICT_LEAD_SHARE of it in one iteration; a dip only just below the line needs a second one.
VERDICT_LEAD_SHARE = 0.3
EVIDENCE_LEAD_SHARE = 0.2


@dataclass(frozen=True)
class HeldStraggler:
    """What the straggler check that slowed this pipeline measured, the same on every rank of the
    pipeline (it comes from the check's collectives): the slowest pipeline's compute time and
    this pipeline's, each normalised to the fastest plan (seconds per iteration)."""

    slowest_s: float
    mine_s: float
    wait_noise_s: float = 0.0  # the pipeline's noisiest rank's spread of waits (ExchangeResult)

    def wait_s(self, planned_extra_s: float) -> float:
        """The wait at the gradient sync a rank of this pipeline should see while the straggler
        lasts, running a setting whose model time is `planned_extra_s` above the fastest plan."""
        return self.slowest_s - self.mine_s - planned_extra_s


@dataclass
class FreeWaits:
    """What a rank waits at the gradient sync with nobody to wait for: its recent waits at the
    unslowed plan in windows a straggler check found free of stragglers (kept on the training
    thread, from device records; a held plan's verdict takes a snapshot, `RecoveryWatch.hold`)."""

    _free: list[tuple[int, float]] = field(default_factory=list)  # (iteration, wait), oldest first

    def observe_free(self, iteration: int, wait_s: float) -> None:
        """A wait at the unslowed plan in a window a check found free of stragglers."""
        self._free.append((iteration, wait_s))
        del self._free[:-FREE_WAIT_SAMPLES]

    @property
    def has_free_wait(self) -> bool:
        return bool(self._free)

    @property
    def free_wait_s(self) -> float:
        waits = [w for _, w in self._free]
        return float(np.quantile(waits, FREE_WAIT_QUANTILE)) if waits else 0.0

    @property
    def noise_s(self) -> float:
        """How far one iteration's free wait strays from the next (the median of the
        absolute differences of consecutive ones: a straggler's onset, a level shift, moves it
        little); 0 before two samples."""
        waits = [w for _, w in self._free]
        return float(np.quantile(np.abs(np.diff(waits)), NOISE_QUANTILE)) if len(waits) > 1 else 0.0


@dataclass
class RecoveryWatch:
    """Tells a pipeline slowed for a measured straggler that it has become the slowest one.

    Why: the straggler's recovery shows at the gradient sync of its first recovered iteration,
    while the straggler checks see it only once a whole check window of records lies after it;
    meanwhile the slowed pipeline holds up the whole job. Each rank reads its own wait at the
    gradient sync (iteration end minus compute end on the device): while the straggler lasts
    it is the straggler's lead over the slowed plan, which the check that chose the plan
    predicts (`HeldStraggler.wait_s`, the planning margin at least); once nobody is slower it
    falls to what the rank waits with nobody to wait for (`free_wait_s`, learnt at the fastest
    plan with no straggler). The verdict needs the wait near the free level (`VERDICT_LEAD_SHARE` of the way up),
    and a predicted lead that stands out of the pipeline's iteration-to-iteration noise (its
    noisiest rank's, from the check); otherwise the straggler checks decide, as before.

    Judged off the training thread, as the device reaches each iteration's end
    (`runtime.recovery.RecoveryJudge`); no collective of its own: the inputs are this rank's
    device times and the check's result, which every rank of the pipeline holds alike (the
    noise rides the check's pipeline reduction); every rank judges every iteration by the same
    rule, so the ranks of a pipeline reach the same verdict on the same iteration whenever
    their waits tell the same story -- on a deterministic device always: the straggler's
    recovery shortens the wait of every stage that was waiting for it at once.
    """

    held: HeldStraggler | None = None
    free_wait_s: float = 0.0  # the rank's free wait when the hold began (`FreeWaits.free_wait_s`)
    # This rank's wait in its first held iterations (median) less the pipeline-level prediction:
    # a stage that ends its computations earlier than the pipeline's last one waits for the
    # straggler's same stage, whose lead differs (None: not calibrated yet, no verdict before).
    _offset_s: float | None = None
    _held_offsets: list[float] = field(default_factory=list)
    _held_seen: int = 0  # held iterations read so far
    _evidence_s: float = 0.0  # how far below the verdict line the waits have added up to (CUSUM)

    def hold(self, held: HeldStraggler | None, free_wait_s: float = 0.0) -> None:
        """A plan slowed for a measured straggler is in force (None: no longer). Each check
        renews the held straggler; this rank's offset, a property of its stage, is kept until
        the pipeline stops being held (a renewal must not calibrate on a recovered iteration)."""
        if held is None:
            self._offset_s = None
            self._held_offsets = []
            self._held_seen = 0
            self._evidence_s = 0.0
        elif self.held is None:
            self.free_wait_s = free_wait_s
        self.held = held

    def observe_held(self, wait_s: float, planned_extra_s: float) -> bool:
        """The first `HELD_CALIBRATION` iterations run while held calibrate this rank's own lead
        (one disturbed iteration does not set it); True while they do. The very first is left
        out: its clocks are still changing and it started when the previous iteration's sync
        released it, not in step with the straggler. A wait with no lead at all before any
        calibration (within the noise of the free wait: a check that measured the straggler
        landed after it recovered) calibrates nothing; the prediction stands and that
        iteration is judged like any other."""
        if self.held is None or self._offset_s is not None:
            return False
        self._held_seen += 1
        if self._held_seen == 1:
            return True
        if not self._held_offsets and wait_s - self.free_wait_s <= NOISE_LEADS * self.held.wait_noise_s:
            self._offset_s = 0.0
            return False
        self._held_offsets.append(wait_s - self.free_wait_s - self.held.wait_s(planned_extra_s))
        if len(self._held_offsets) >= HELD_CALIBRATION:
            self._offset_s = float(np.median(self._held_offsets))
        return True

    def threshold_s(self, planned_extra_s: float) -> float | None:
        """The wait below which the iteration says "this pipeline is the slowest", for a setting
        `planned_extra_s` slower than the fastest plan; None when the lead predicted for it does
        not stand out of the noise (the verdict is then left to the straggler checks)."""
        if self.held is None or self._offset_s is None:
            return None
        lead = self.held.wait_s(planned_extra_s) + self._offset_s
        if lead <= NOISE_LEADS * self.held.wait_noise_s or lead <= 0.0:
            return None
        return self.free_wait_s + VERDICT_LEAD_SHARE * lead

    def became_slowest(self, wait_s: float, planned_extra_s: float) -> bool:
        """The verdict on one more iteration. Waits below the verdict line add up as evidence and
        waits above it take it back (a cumulative sum); the verdict comes once the evidence
        exceeds the pipeline's wait noise and `EVIDENCE_LEAD_SHARE` of the predicted lead: at the
        first recovered iteration where the wait falls to the free wait (a deterministic device),
        or where one iteration's wait only dips below the line, after a second one confirms it
        -- one noisy iteration does not make plans flap."""
        threshold = self.threshold_s(planned_extra_s)
        if threshold is None:
            return False
        lead_s = (threshold - self.free_wait_s) / VERDICT_LEAD_SHARE
        self._evidence_s = max(0.0, self._evidence_s + threshold - wait_s)
        return self._evidence_s > max(self.held.wait_noise_s, EVIDENCE_LEAD_SHARE * lead_s)
