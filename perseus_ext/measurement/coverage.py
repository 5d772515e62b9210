"""Clock coverage on a real GPU: how much compute time ran at the clock the plan asked for.

A simulated device knows it exactly (`DeviceTimeline.exact_coverage()`); a real one does not
report which clock each kernel met. What it does report is when each computation ran (CUDA event
timestamps) and when the controller's set calls returned. Replaying those calls through the same
switch-then-ramp clock model the simulator uses (`gpu.clock_ramp`) and the GPU's `SwitchLatency`
gives the estimate, so a controller can tell whether its clocks land where the GPU computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from perseus_ext.measurement.gpu.clock_ramp import ClockTrajectory
from perseus_ext.measurement.gpu.timeline import CoverageTally, SwitchLatency


def estimate_coverage(
    computations: Sequence[tuple[float, float, int | None]],
    changes: Sequence[tuple[float, int | None]],
    latency: SwitchLatency,
    initial_clock_mhz: int | None,
    *,
    default_clock_mhz: int | None = None,
) -> CoverageTally:
    """Estimated coverage of `computations` under the clock `changes`.

    computations: (device start s, device end s, planned MHz or None = no plan; not counted).
    changes: (time the set call returned, target MHz or None = back to the driver default), on
    the same clock as the computations, in any order.
    initial_clock_mhz: the clock before the first change (None = driver default).
    default_clock_mhz: what the driver default is (normally the max clock); unknown (None) means
    time at the default never counts as covered, and neither does a ramp to or from it.
    """
    default = math.nan if default_clock_mhz is None else float(default_clock_mhz)
    trajectory = ClockTrajectory(
        default if initial_clock_mhz is None else initial_clock_mhz,
        switch_s=latency.switch_s,
        transition_s=latency.transition_s,
    )
    for issued_at, target in sorted(changes, key=lambda change: change[0]):
        trajectory.request(issued_at, default if target is None else target)
    tally = CoverageTally()
    for start, end, planned in computations:
        if planned is None:
            continue
        if end < start:
            raise ValueError(f"computation ({start}, {end}, {planned}) ends before it starts")
        tally.planned_s += end - start
        tally.covered_s += sum(
            high - low for low, high, clock in trajectory.segments(start, end) if clock == planned
        )
    return tally
