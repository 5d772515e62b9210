"""The whole emulated job's power swing (`perseus_ext.emulator.swing`): the trace of a tiny
2-stage, 2-pipeline job with a straggler and a gradient-sync gap, written down by hand, its
figures computed by hand from that trace, and the printout of `perseus-ext emulate`."""

from __future__ import annotations

import numpy as np
import pytest

from perseus_ext.cli import main
from perseus_ext.emulator import MAX_CLOCK, PERSEUS, STRATEGIES, Emulator, JobLayout, StragglerScenario
from perseus_ext.emulator.swing import SyncGap, deployment_of, job_power_trace, job_swings
from perseus_ext.planning.profile import load_profile

# stage, kind, MHz, s, J: at 1410 MHz stage 0 draws 300 W forward and 400 W backward, stage 1
# 250 W and 350 W; 1200 MHz is slower and cheaper (the planner's other choice)
PROFILE = """stage,instruction,frequency,time,energy
0,forward,1410,0.2,60
0,backward,1410,0.4,160
0,forward,1200,0.25,55
0,backward,1200,0.5,150
1,forward,1410,0.2,50
1,backward,1410,0.4,140
1,forward,1200,0.25,46
1,backward,1200,0.5,132
"""
BLOCKING_W = 50.0
GAP = SyncGap(seconds=0.3, power_w=20.0)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("swing") / "tiny.csv"
    path.write_text(PROFILE)
    return path


@pytest.fixture(scope="module")
def emulation(profile_path):
    """TP 1 x PP 2 x DP 2, one microbatch (F0, F1, B1, B0 back to back), one pipeline 1.5 x slower."""
    layout = JobLayout(tensor_parallel=1, pipeline_parallel=2, global_batch=2, microbatches=1)
    emulator = Emulator(load_profile(profile_path), layout, BLOCKING_W)
    return emulator, emulator.run(StragglerScenario.fixed(1.5))


# By hand, all GPUs at 1410 MHz: a pipeline runs F0 [0, 0.2) on stage 0 (300 W, stage 1 waits
# at 50 W), F1 [0.2, 0.4) (50 + 250 W), B1 [0.4, 0.8) (50 + 350 W), B0 [0.8, 1.2) (400 + 50 W).
# Two pipelines in lockstep double it; the straggler's iteration ends at T' = 1.5 x 1.2 = 1.8 s,
# so both hold 4 GPUs x 50 W until then; the gap: 0.3 s at 4 x 20 W.
HAND_EDGES = [0.0, 0.2, 0.4, 0.8, 1.2, 1.8, 2.1]
HAND_POWER = [700.0, 600.0, 800.0, 900.0, 200.0, 80.0]


def test_the_max_clock_job_trace_is_the_hand_written_one(emulation):
    emulator, result = emulation
    trace = job_power_trace(emulator, deployment_of(result, MAX_CLOCK), GAP)
    segments = np.diff(trace.breakpoints_s) > 1e-9  # (near-)zero-length segments of simultaneous events dropped
    edges = np.append(trace.breakpoints_s[:-1][segments], trace.period_s)
    assert edges == pytest.approx(HAND_EDGES)
    assert trace.power_w[segments] == pytest.approx(HAND_POWER)


def test_the_max_clock_figures_are_the_hand_computed_ones(emulation):
    emulator, result = emulation
    (swing,) = job_swings(emulator, result, GAP, strategies=(MAX_CLOCK,))
    durations = np.diff(HAND_EDGES)
    energy = float(np.dot(durations, HAND_POWER))  # 1084 J
    mean = energy / 2.1
    variance = float(np.dot(durations, (np.array(HAND_POWER) - mean) ** 2)) / 2.1
    figures = swing.figures
    assert energy == pytest.approx(1084.0) and swing.energy_j == pytest.approx(energy)
    assert swing.period_s == pytest.approx(2.1) and figures.mean_w == pytest.approx(mean)
    assert figures.peak_to_trough_w == pytest.approx(900.0 - 80.0)
    assert figures.peak_to_trough_fraction == pytest.approx(820.0 / mean)
    # the largest step (900 -> 200 W at 1.2 s) seen through a 50 ms moving average; every step is
    # more than 50 ms from the next, so the average ramps the whole step within its window
    assert figures.max_ramp_w_per_s == pytest.approx(700.0 / 0.05)
    assert figures.band_energy_w2 == pytest.approx(figures.band_energy_fraction * variance, rel=1e-6)
    assert 0.5 < figures.band_energy_fraction < 1.0  # a 2.1 s period: most of a step trace's variance is below 20 Hz


def test_every_strategy_s_trace_holds_the_emulator_s_energy(emulation):
    """Without the gap the trace's integral is the emulator's own energy split of the iteration
    (computation + bubble + sync wait + straggler stall), summed by separate code."""
    emulator, result = emulation
    assert STRATEGIES
    for strategy in STRATEGIES:
        trace = job_power_trace(emulator, deployment_of(result, strategy), SyncGap(0.0, 0.0))
        iteration = result.outcomes[strategy].iteration
        assert trace.period_s == pytest.approx(iteration.time)
        assert trace.energy_j == pytest.approx(iteration.total)
    with_gap = job_power_trace(emulator, deployment_of(result, PERSEUS), GAP)
    assert with_gap.energy_j == pytest.approx(result.outcomes[PERSEUS].iteration.total + 0.3 * 4 * 20.0)


def test_emulate_prints_the_swing_of_both_plans(profile_path, capsys):
    assert main(["emulate", "--profile", str(profile_path), "--global-batch", "2", "--microbatches", "1",
                 "--blocking-power", "50", "--slowdown", "1.5", "--sync-gap-s", "0.3",
                 "--sync-gap-power", "20"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Power swing of the whole job"):].splitlines()
    assert "gradient sync + optimizer step 0.3 s at 20 W per GPU" in " ".join(table[:2])
    header = next(line for line in table if "strategy" in line)
    assert "peak-trough W" in header and "max ramp W/s" in header
    assert all(len(line) <= 100 for line in table[:table.index(header) + 4])
    row = next(line for line in table if line.strip().startswith("all max clock")).split()
    # strategy label, period, mean, peak-to-trough, % of mean, ramp, band, band %
    assert row[-7:-2] == ["2.10", f"{1084 / 2.1:.3f}", "820.000", f"{100 * 820 / (1084 / 2.1):.1f}%", "14000.00"]
    assert any(line.strip().startswith("perseus-ext ") for line in table)
    assert "definitions: docs/power.md" in out


def test_a_negative_gap_is_refused_like_every_flag(profile_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["emulate", "--profile", str(profile_path), "--microbatches", "1", "--sync-gap-s", "-1"])
    assert exit_info.value.code == 2
    assert "--sync-gap-s" in capsys.readouterr().err
