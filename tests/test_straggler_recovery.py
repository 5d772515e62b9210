"""A pipeline slowed for a straggler runs its fastest plan's clocks right after the straggler's first
recovered iteration, on every rank of the pipeline, with no collective beyond the straggler checks
and no wait for a device record on the training thread.

Two ranks (the two stages of pipeline 0) each run their own `PlanDeployment` on a frontier solved
from the deterministic simulated A100's own model (`pace=0`: exact times and energies). A small
in-process bus stands in for gloo: it reduces and broadcasts exactly as the control plane does,
and adds pipeline 1's contribution to the data-parallel step. The device is modelled from the
same model: a stage's compute time is the model time of what it runs (its plan's, or the fastest
plan's once its straggler episode is overridden) less the part of the iteration after its last
computation; its wait at the gradient sync is how much later the straggler's same stage
finishes. As on hardware the host runs an iteration ahead: each rank's `RecoveryJudge` sees an
iteration's compute end and end (the observer thread's observations) while the host launches
the next iteration, at whose end boundary its record reaches the deployment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from perseus_ext.actuation.observer import Observation
from perseus_ext.measurement.gpu import open_gpu
from perseus_ext.planning.profile import Profile
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.planning.solver import SolverOptions, solve_frontier
from perseus_ext.policies.base import StragglerPolicy
from perseus_ext.runtime import PerseusConfig
from perseus_ext.runtime.baseline import BaselineProbes
from perseus_ext.runtime.comm import ControlPlane, Pending
from perseus_ext.runtime.deployment import PlanDeployment
from perseus_ext.runtime.records import StageSolve
from perseus_ext.observability.iteration import IterationRecord
from perseus_ext.runtime.recorder import COMPUTE_END, END

FORWARD_S, BACKWARD_S = (0.025, 0.035), (0.050, 0.070)
SLOWDOWN = 1.2
TAIL_S = 0.004  # gradient transfer and optimizer step after the last computation
STAGE_LEAD_S = (0.0, 0.05)  # how long before stage 0's last computation each stage's ends
STRAGGLER_START = 12


def straggler_end(interval: int) -> int:
    """Long enough for two checks to confirm the straggler and the slowed plan to run a while."""
    return STRAGGLER_START + 3 * interval + 10


def iterations(interval: int) -> int:
    return straggler_end(interval) + 14


@pytest.fixture(scope="module")
def frontier():
    gpu = open_gpu("sim:a100_sxm?pace=0")
    rows = [{"stage": stage, "instruction": kind, "frequency": clock,
             "time": gpu.expected(seconds[stage], clock)[0], "energy": gpu.expected(seconds[stage], clock)[1]}
            for stage in (0, 1) for kind, seconds in (("forward", FORWARD_S), ("backward", BACKWARD_S))
            for clock in gpu.supported_sm_clocks()[::12]]
    return solve_frontier(build_schedule("1f1b", 2, 4), Profile.from_rows(rows), blocking_power=60.0,
                          options=SolverOptions(min_grid_points=200))


@dataclass
class Bus:
    """gloo's reductions and broadcasts among the ranks of pipeline 0, in call order; pipeline 1
    (the straggler, always at its fastest plan) joins every data-parallel reduction."""

    straggler_s: float
    calls: dict[tuple[str, int], list[list[float]]] = field(default_factory=dict)


class BusPlane(ControlPlane):
    """Stage `stage` of pipeline 0 on the bus (stage 0 leads the pipeline)."""

    def __init__(self, bus: Bus, stage: int) -> None:
        super().__init__(stage=stage)
        self.bus, self._seq = bus, {}

    @property
    def is_pipeline_leader(self) -> bool:
        return self.stage == 0

    def _slot(self, group: str) -> list[list[float]]:
        seq = self._seq[group] = self._seq.get(group, -1) + 1
        return self.bus.calls.setdefault((group, seq), [])

    def start_max(self, group: str, values) -> Pending:
        slot = self._slot(group)
        slot.append([float(v) for v in values])
        if group == "peers":  # pipeline 1's stage at the straggler's compute time
            slot.append([self.bus.straggler_s, -self.bus.straggler_s, 0.0, 0.0])
        return _Lazy(lambda: [max(column) for column in zip(*slot)])

    def start_broadcast_pipeline(self, values, length: int) -> Pending:
        slot = self._slot("broadcast")
        if values is not None:
            slot.append([float(v) for v in values])
        return _Lazy(lambda: slot[0])

    def broadcast_pipeline(self, obj):
        slot = self._slot("object")
        if self.is_pipeline_leader:
            slot.append(obj)
        return slot[0]


class _Lazy(Pending):
    """Read when the next boundary collects it, once every rank has called (as gloo waits)."""

    def __init__(self, read) -> None:
        super().__init__([])
        self._read = read

    def result(self) -> list[float]:
        return list(self._read())


def stage_compute_s(plan_time_s: float, stage: int, slowdown: float = 1.0) -> float:
    return (plan_time_s - STAGE_LEAD_S[stage]) * slowdown


@dataclass
class Run:
    """What pipeline 0's ranks did: the plan each planned (launched) and the plan whose clocks its
    device ran, per iteration from 1 on."""

    ranks: list[PlanDeployment]
    planned: list[list[int]]
    ran: list[list[int]]


def run_pipeline(frontier, interval: int, end: int | None = None) -> Run:
    """Pipeline 0's two ranks through the straggler's onset and recovery (at `end`, by default
    `straggler_end(interval)`)."""
    end = straggler_end(interval) if end is None else end
    config = PerseusConfig.from_dict({"enabled": True, "gpu": "sim:a100_sxm?pace=0", "straggler_check_interval": interval,
                                      "baseline_fraction": 0.0})
    fastest = frontier.fastest.time
    bus = Bus(straggler_s=fastest)
    schedule = build_schedule("1f1b", 2, 4)
    ranks = [PlanDeployment(StageSolve(stage, frontier.stage_table(stage), None, 0.0, False, None, frontier),
                            StragglerPolicy(), config, BusPlane(bus, stage), schedule) for stage in (0, 1)]
    probes = BaselineProbes(0.0, interval)
    for deployment in ranks:
        deployment.deploy(0)
    run = Run(ranks, [[], []], [[], []])
    launched: list[list[tuple]] = [[], []]  # per rank: (setting, recovery program) not yet run by the device
    records: list[list[IterationRecord]] = [[], []]  # run by the device, handed to the host at the next boundary
    device_s = 0.0
    for iteration in range(1, end + 14):
        for stage, deployment in enumerate(ranks):  # the host launches the iteration
            setting = deployment.iteration_setting(iteration, iteration - 1, probes, fell_back=False)
            launched[stage].append((setting, deployment.recovery_program(setting)))
            run.planned[stage].append(setting.plan)
        # The device runs the previous iteration while the host launches this one.
        straggling = STRAGGLER_START <= iteration - 1 < end
        bus.straggler_s = fastest * (SLOWDOWN if straggling else 1.0)
        for stage, deployment in enumerate(ranks):
            if iteration == 1:
                continue
            setting, program = launched[stage].pop(0)
            overridden = program is not None and program.episode in deployment.judge.overridden
            plan = 0 if overridden else setting.plan
            run.ran[stage].append(plan)
            own = stage_compute_s(frontier.plans[plan].time, stage)
            peer = stage_compute_s(fastest, stage, SLOWDOWN if straggling else 1.0)
            wait = max(0.0, peer - own)
            deployment.judge.observed(Observation((setting.iteration, COMPUTE_END), device_s + own, 0.0, None))
            deployment.judge.observed(Observation((setting.iteration, END), device_s + own + wait + TAIL_S, 0.0, None))
            records[stage].append(IterationRecord(setting, stage, 0, stage, own + wait + TAIL_S, own, 1.0, 1.0, 0.0))
        device_s += 1.0
        for stage, deployment in enumerate(ranks):  # the leader first, as its broadcast is read later
            arrived, records[stage] = records[stage], []
            deployment.on_iteration(iteration, arrived, None)
    return run


@pytest.mark.parametrize("interval", [2, 10])
def test_the_slowed_pipeline_runs_fast_from_the_iteration_after_the_straggler_recovers(frontier, interval):
    run = run_pipeline(frontier, interval)
    ranks, planned, ran = run.ranks, run.planned, run.ran
    assert planned[0] == planned[1] and ran[0] == ran[1]  # both stages plan and run the same plan throughout
    end, total = straggler_end(interval), iterations(interval)
    plans = dict(zip(range(1, total), planned[0]))
    runs = dict(zip(range(1, total - 1), ran[0]))  # the device is an iteration behind the host
    slowed = [i for i, p in runs.items() if p != 0]
    assert slowed and min(slowed) > STRAGGLER_START  # slowed for the straggler, after measuring it
    assert all(frontier.plans[runs[i]].time < frontier.fastest.time * SLOWDOWN for i in slowed)  # never the slowest
    # Recovery: the straggler is fast from its iteration `end` on, which shows at that iteration's
    # gradient sync (the judge, on the device's side): every later iteration runs the fastest
    # plan's clocks -- `end + 1` too, which the host had launched at the slowed plan before the
    # verdict came (the override) -- and every iteration launched after that boundary is planned
    # at the fastest plan.
    after = [runs[i] for i in range(end + 1, total - 1)]
    assert after and set(after) == {0}, runs
    assert max(slowed) == end
    assert plans[end + 1] != 0 and all(plans[i] == 0 for i in range(end + 2, total)), plans
    switches = [[(s.iteration, s.plan) for s in r.switches] for r in ranks]
    assert switches[0] == switches[1]
    back = ranks[0].switches[-1]
    assert back.iteration == end + 1 and back.plan == 0 and back.factor == 1.0
    assert "became the slowest" in back.reason and f"in iteration {end}," in back.reason
    assert ranks[0].tracker.factor == 1.0 and ranks[0].episode is None


def test_no_return_while_the_straggler_lasts(frontier):
    """The wait the slowed plan leaves at the sync stays well above the verdict's threshold."""
    run = run_pipeline(frontier, 2)
    end = straggler_end(2)
    held = [i for i, p in zip(range(1, iterations(2)), run.ran[0]) if STRAGGLER_START <= i < end and p != 0]
    assert held and held == list(range(held[0], end))  # one slowed stretch up to the recovery, no flapping


def test_a_check_that_measured_a_straggler_gone_since_slows_nothing(frontier):
    """Checks every 10 iterations: the straggler lasts long enough for one check to see it and
    the next to confirm it, but recovers before that check's plan switch; the pipeline's waits
    since then say nobody is slower, so it keeps its fastest plan."""
    interval = 10
    end = STRAGGLER_START + 2 * interval - 3  # the confirming check decides at 29 and switches at 30
    run = run_pipeline(frontier, interval, end)
    assert run.planned[0] == run.planned[1]
    assert all(plan == 0 for plan in run.planned[0][end:]), run.planned[0]
    assert all(plan == 0 for plan in run.ran[0][end:]), run.ran[0]
    assert all(r.tracker.factor == 1.0 for r in run.ranks)
